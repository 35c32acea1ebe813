"""Prompt lookup: the index gives what a scan of the whole sequence would, without scanning."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pytgi_shard.speculative.ngram import NgramIndex


def scanned(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """The definition: the longest suffix n-gram's latest occurrence that ends before the
    sequence's end, and the k tokens after it."""
    end = len(tokens)
    for n in range(min(max_n, end), min_n - 1, -1):
        suffix = tokens[end - n:]
        for stop in range(end - 1, n - 1, -1):
            if tokens[stop - n:stop] == suffix:
                return tokens[stop:stop + k]
    return []


def test_a_quoted_span_is_proposed_from_where_it_was_quoted() -> None:
    index = NgramIndex()
    index.extend([5, 6, 7, 8, 9, 1, 2, 6, 7])
    assert index.propose(3) == [8, 9, 1]


def test_nothing_is_proposed_for_a_fresh_suffix_or_no_room() -> None:
    index = NgramIndex()
    index.extend([1, 2, 3])
    assert index.propose(4) == []
    index.extend([1])
    assert index.propose(0) == []
    assert index.propose(2) == [2, 3]


def test_the_longest_match_wins_over_a_later_shorter_one() -> None:
    index = NgramIndex(max_n=2)
    # (3, 4) occurred once, followed by 9; 4 alone occurred later, followed by 7.
    index.extend([3, 4, 9, 4, 7, 3, 4])
    assert index.propose(1) == [9]


def test_bad_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="n-gram lengths"):
        NgramIndex(max_n=1, min_n=2)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), min_size=1, max_size=8),
    st.integers(0, 5),
    st.integers(1, 4),
    st.integers(1, 4),
)
def test_the_index_equals_a_scan_after_every_extension(
    pieces: list[list[int]], k: int, a: int, b: int
) -> None:
    min_n, max_n = min(a, b), max(a, b)
    index = NgramIndex(max_n=max_n, min_n=min_n)
    tokens: list[int] = []
    for piece in pieces:
        index.extend(piece)
        tokens += piece
        assert index.propose(k) == (scanned(tokens, k, max_n, min_n) if k else [])

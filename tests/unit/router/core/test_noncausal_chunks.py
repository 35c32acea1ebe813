"""Bidirectional spans in the router: a prefill chunk never ends inside one
(step_plan.span_safe_length), and the prefix cache keys a span's tokens by the whole span
(prefix_cache.span_keyed), so a cache hit ending inside a span is one whose span is the same."""

from __future__ import annotations

import pytest

from pytgi_router.core.prefix_cache import span_keyed
from pytgi_router.core.step_plan import span_safe_length

SPANS = [(3, 10), (12, 20)]


@pytest.mark.parametrize(("start", "length", "expected"), [
    (0, 2, 2),     # before the first span
    (0, 3, 3),     # ends where a span starts
    (0, 5, 3),     # would end inside [3, 10): ends before it
    (0, 10, 10),   # ends where it ends
    (3, 4, 7),     # starts at the span: takes it whole, past the budget
    (0, 15, 12),   # past the first, inside the second: ends before the second
    (12, 1, 8),    # the second whole from its start
    (10, 30, 30),  # past every span
    (5, 2, 5),     # starts inside (a cache hit in a span): on to its end
])
def test_a_chunk_never_ends_inside_a_span(start: int, length: int, expected: int) -> None:
    assert span_safe_length(SPANS, start, length) == expected
    end = start + span_safe_length(SPANS, start, length)
    assert not any(lo < end < hi for lo, hi in SPANS)


def test_span_keys_depend_on_the_whole_span() -> None:
    prompt = [5, 6, 7, 8, 9, 10, 11]
    other_end = [5, 6, 7, 8, 9, 10, 12]
    a, b = span_keyed(prompt, [(1, 6)]), span_keyed(other_end, [(1, 6)])
    assert a[0] == 5 and a[6] == 11  # outside the span: the tokens themselves
    assert a[1:6] == span_keyed(prompt, [(1, 6)])[1:6]  # the same span: the same keys
    assert len(set(a[1:6])) == 5 and all(k < 0 for k in a[1:6])
    # The same span, a different token after it: the span's keys are shared.
    assert a[1:6] == b[1:6]
    # A different last token inside the span changes every key of it (no hit inside it).
    c = span_keyed([5, 6, 7, 8, 9, 0, 11], [(1, 6)])
    assert not set(a[1:6]) & set(c[1:6])

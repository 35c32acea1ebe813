"""Prompt lookup (n-gram) drafting: the drafter that needs no weights (TGI's `--speculate N`).

A sequence that quotes its own context (code edits, summaries, RAG answers, agents repeating a
tool's output) continues an n-gram it already holds; the tokens that followed that n-gram last
time are a cheap guess of what follows now, and one forward of the target checks them all.

Drafting runs every step for every speculating row, and must cost almost nothing when it
misses, so nothing here scans the context: each sequence keeps an index from every n-gram it
holds (for the lengths it matches on) to where that n-gram last ended, updated in O(max_n) per
appended token. A proposal is then max_n dictionary lookups and one slice.
"""

from __future__ import annotations

from collections.abc import Sequence

# The longest and shortest n-grams matched: a longer match is more likely to continue the same
# way, so the longest found wins; one token alone still pays in repetitive text (TGI matches
# single tokens too).
MAX_NGRAM = 3
MIN_NGRAM = 1


class NgramIndex:
    """One sequence's tokens and, per n-gram, the position just after its latest occurrence
    that is not the sequence's own end (whose continuation is what is being guessed)."""

    __slots__ = ("tokens", "max_n", "min_n", "_last", "_pending")

    def __init__(self, max_n: int = MAX_NGRAM, min_n: int = MIN_NGRAM) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram lengths must satisfy 1 <= min ({min_n}) <= max ({max_n})")
        self.tokens: list[int] = []
        self.max_n = max_n
        self.min_n = min_n
        # n-gram -> the index just after its latest indexed occurrence.
        self._last: dict[tuple[int, ...], int] = {}
        # The n-grams ending at the sequence's end are indexed one token late: indexed now, a
        # lookup of the current suffix would find itself, with nothing after it.
        self._pending: list[tuple[tuple[int, ...], int]] = []

    def extend(self, tokens: Sequence[int]) -> None:
        """Appends `tokens` (the prompt at first, then each step's accepted tokens)."""
        for token in tokens:
            self._append(token)

    def _append(self, token: int) -> None:
        for gram, end in self._pending:
            self._last[gram] = end
        self.tokens.append(token)
        end = len(self.tokens)
        self._pending = [
            (tuple(self.tokens[end - n:end]), end)
            for n in range(self.min_n, min(self.max_n, end) + 1)
        ]

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens that followed the longest suffix n-gram's latest earlier occurrence;
        [] when no suffix occurred before (or k is 0)."""
        if k <= 0:
            return []
        end = len(self.tokens)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            start = self._last.get(tuple(self.tokens[end - n:]))
            if start is not None:
                return self.tokens[start:start + k]
        return []

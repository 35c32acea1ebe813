"""What the shard keeps of constrained requests' grammars between requests, under a byte budget.

Two kinds of entries share one budget, in one least-recently-used order:

- a grammar's llguidance source (the JSON Schema or regex turned into llguidance's grammar, and
  proven to compile): a later request with the same grammar skips the conversion and is known
  valid;
- prepared matchers: one per PrepareGrammar, built in the compile pool for the request about to
  be scheduled, its first mask computed (shard/structured_output/compiler.py). A step takes one, oldest first, for
  each constrained request that samples.

Each request's matcher is its own, never a copy of a shared one: llguidance's deep_copy shares
the lexer's lazily built automaton (and its error state) between every copy and the original,
so one request whose regex blows up the automaton ("too many expressions constructed") would
fail every later request of that grammar, and the automaton would grow for as long as the grammar
is cached. A matcher's memory is not something llguidance reports: `matcher_bytes` estimates it
from its grammar's size (measured: 80-220 bytes per byte of llguidance source for large
grammars, a 10,000-property schema's matcher ~58 MB), which is what the budget counts.

Eviction goes oldest first, and a prepared matcher counts from when it was built: a request
cancelled after its PrepareGrammar leaves its matcher behind (the next request of that grammar
takes it), and those are the oldest. The newest entry always stays, so the budget can be exceeded
by one matcher at most and a matcher larger than the budget is still served.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from itertools import count
from typing import Generic, TypeVar, cast

import llguidance
import numpy as np

# A matcher's estimated memory: a fixed part (parser state, the first mask's words, llguidance's
# own bookkeeping) and a part per byte of its llguidance source (measured, see above).
MATCHER_BASE_BYTES = 64 * 1024
MATCHER_BYTES_PER_SOURCE_BYTE = 256

K = TypeVar("K")


@dataclass(slots=True)
class Prepared:
    """One request's own matcher, built off the step with its first mask computed: `words` is
    that mask ([mask_width] int32 bitmask words), so the request's first step computes nothing."""

    matcher: llguidance.LLMatcher
    words: np.ndarray


@dataclass(frozen=True, slots=True)
class _Slot:
    """A prepared matcher's place in the order (a source's place is its key)."""

    number: int


def matcher_bytes(source: str, mask_width: int) -> int:
    """The estimated memory of one matcher of `source` with its first mask."""
    return MATCHER_BASE_BYTES + MATCHER_BYTES_PER_SOURCE_BYTE * len(source) + 4 * mask_width


class GrammarCache(Generic[K]):
    """Grammars' sources and prepared matchers by key, within `budget_bytes`. Not thread-safe:
    the compiler holds its lock around every call."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.bytes = 0
        self._sources: dict[K, str] = {}
        self._prepared: dict[_Slot, tuple[K, Prepared]] = {}
        self._ready: dict[K, deque[_Slot]] = {}
        # Every entry's size, least recently used first: a source by its key, a prepared
        # matcher by its slot.
        self._order: OrderedDict[object, int] = OrderedDict()
        self._numbers = count()

    def source(self, key: K) -> str | None:
        """The grammar's source, when known (a use: it moves to the end of the order)."""
        source = self._sources.get(key)
        if source is not None:
            self._order.move_to_end(key)
        return source

    def add_source(self, key: K, source: str) -> None:
        if key in self._sources:
            return
        self._sources[key] = source
        self._add(key, len(source))

    def add_prepared(self, key: K, prepared: Prepared, size: int) -> None:
        """A matcher built for a request of `key` that is about to be scheduled."""
        slot = _Slot(next(self._numbers))
        self._prepared[slot] = (key, prepared)
        self._ready.setdefault(key, deque()).append(slot)
        self._add(slot, size)

    def take(self, key: K) -> Prepared | None:
        """The oldest matcher prepared for `key` (it leaves the cache), or None."""
        ready = self._ready.get(key)
        if not ready:
            return None
        slot = ready.popleft()
        if not ready:
            del self._ready[key]
        self.bytes -= self._order.pop(slot)
        return self._prepared.pop(slot)[1]

    def prepared_count(self, key: K) -> int:
        return len(self._ready.get(key, ()))

    def __len__(self) -> int:
        """How many grammars' sources are kept."""
        return len(self._sources)

    def _add(self, entry: object, size: int) -> None:
        self._order[entry] = size
        self.bytes += size
        while self.bytes > self.budget_bytes and len(self._order) > 1:
            self._evict()

    def _evict(self) -> None:
        """Drops the least recently used entry."""
        entry, size = self._order.popitem(last=False)
        self.bytes -= size
        if not isinstance(entry, _Slot):
            del self._sources[cast(K, entry)]
            return
        key, _ = self._prepared.pop(entry)
        ready = self._ready[key]
        ready.remove(entry)
        if not ready:
            del self._ready[key]

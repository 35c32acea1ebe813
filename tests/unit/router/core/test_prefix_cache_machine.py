"""PrefixCache under random admit / prefill / decode (grow) / preempt / finish / cancel / restart.

The model holds what the shard stores in each slot of each block (the KV of a token is identified
by the whole token prefix it was computed from), so a cache hit is checked to hand out only blocks
holding exactly the KV the new sequence would have computed, and no shared block is ever written.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from pytgi_router.core.prefix_cache import PrefixCache, PrefixCacheSnapshot, root_key

TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=10)
PICK = st.integers(0, 1 << 16)
# The LoRA adapter a sequence runs under (0: the base model): its KV depends on it.
ADAPTER = st.sampled_from([0, 0, 1, 2])


@dataclass
class ModelSequence:
    tokens: list[int]
    table: list[int]
    written: int  # tokens whose KV is in the blocks (and committed)
    adapter: int = 0


@dataclass
class Model:
    live: dict[int, ModelSequence] = field(default_factory=dict)
    # (tokens, adapter) of each preempted sequence.
    preempted: list[tuple[list[int], int]] = field(default_factory=list)
    # What the shard holds in each slot of each block: (adapter, *the token prefix) its KV was
    # computed from.
    stored: dict[int, list[tuple[int, ...] | None]] = field(default_factory=dict)
    # Every sequence committed, to draw new prompts sharing their prefixes.
    seen: list[list[int]] = field(default_factory=list)


def pick(ids: list[int], index: int) -> int:
    return sorted(ids)[index % len(ids)]


class PrefixCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache = PrefixCache(num_blocks=2, block_size=1)
        self.model = Model()
        self.next_id = 0
        self.fresh_token = 100
        self.admissions_since_restart = 0

    @initialize(
        num_blocks=st.integers(2, 40),
        block_size=st.integers(1, 3),
        caching=st.sampled_from([True, True, True, False]),
    )
    def setup(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.cache = PrefixCache(num_blocks, block_size, prefix_caching=caching)

    # Helpers

    def _expected_hits(
        self, snap: PrefixCacheSnapshot, tokens: list[int], adapter: int
    ) -> list[int]:
        """The cached chain of `tokens` under `adapter`, walked over the snapshot's index
        independently."""
        by_key = {key: block for block, key in snap.index.items()}
        size = self.cache.block_size
        hits: list[int] = []
        parent: int | None = root_key(adapter)
        for position in range((len(tokens) - 1) // size):
            block = by_key.get((parent, tuple(tokens[position * size:(position + 1) * size])))
            if block is None:
                break
            hits.append(block)
            parent = block
        return hits

    def _check_lru_evictions(self, before: PrefixCacheSnapshot, spared: set[int]) -> None:
        """The blocks that left the index were the least recently used ones, in order."""
        after = self.cache.snapshot()
        candidates = [b for b in before.evictable if b not in spared]
        evicted = [b for b in candidates if b not in after.index]
        assert evicted == candidates[:len(evicted)]

    def _admit(self, tokens: list[int], reserve: int, adapter: int = 0) -> None:
        cache = self.cache
        before = cache.snapshot()
        needed = cache.blocks_needed(tokens, reserve, adapter=adapter)
        free = cache.free_count
        hits = self._expected_hits(before, tokens, adapter) if cache.prefix_caching else []
        seq_id = self.next_id
        self.next_id += 1
        self.admissions_since_restart += 1
        admission = cache.admit(seq_id, tokens, reserve, adapter=adapter)
        if admission is None:
            assert needed > free
            assert cache.snapshot() == before
            self.model.preempted.append((tokens, adapter))
            return
        size = cache.block_size
        assert needed <= free and cache.free_count == free - needed
        assert admission.cached_tokens == len(hits) * size < len(tokens)
        assert list(admission.blocks[:len(hits)]) == hits
        assert len(admission.blocks) == cache.blocks_for(len(tokens) + reserve)
        assert 0 not in admission.blocks
        for position, block in enumerate(hits):
            # A hit holds exactly the KV this sequence would have computed, under its adapter.
            assert self.model.stored[block] == [
                (adapter, *tokens[:position * size + slot + 1]) for slot in range(size)
            ]
        self._check_lru_evictions(before, set(hits))
        self.model.live[seq_id] = ModelSequence(
            list(tokens), list(admission.blocks), admission.cached_tokens, adapter)

    def _compute(self, seq_id: int) -> None:
        """The shard writes the KV of every pending token, then the router commits it."""
        seq = self.model.live[seq_id]
        snap = self.cache.snapshot()
        size = self.cache.block_size
        for position in range(seq.written, len(seq.tokens)):
            block = seq.table[position // size]
            # Only a block this sequence alone holds, outside the index, is ever written.
            assert snap.refs[block] == 1 and block not in snap.pins and block not in snap.index
            slots = self.model.stored.setdefault(block, [None] * size)
            slots[position % size] = (seq.adapter, *seq.tokens[:position + 1])
        seq.written = len(seq.tokens)
        self.cache.commit(seq_id, seq.tokens)
        self.model.seen.append(list(seq.tokens))

    def _release(self, seq_id: int) -> ModelSequence:
        self.cache.release(seq_id)
        return self.model.live.pop(seq_id)

    # Rules

    @rule(tokens=TOKENS, reserve=st.integers(0, 4), adapter=ADAPTER)
    def admit(self, tokens: list[int], reserve: int, adapter: int) -> None:
        self._admit(tokens, reserve, adapter)

    @precondition(lambda self: self.model.seen)
    @rule(index=PICK, keep=st.integers(2, 12), suffix=TOKENS, reserve=st.integers(0, 4),
          adapter=ADAPTER)
    def admit_sharing(
        self, index: int, keep: int, suffix: list[int], reserve: int, adapter: int
    ) -> None:
        """A prompt starting like one computed before (a system prompt, a conversation),
        under the same adapter or another one (then nothing may be shared)."""
        prompt = self.model.seen[index % len(self.model.seen)]
        self._admit(prompt[:keep] + suffix, reserve, adapter)

    @rule(length=st.integers(1, 16), reserve=st.integers(0, 4))
    def admit_unshared(self, length: int, reserve: int) -> None:
        """Pressure: a prompt nobody shares, to make room by evicting."""
        tokens = list(range(self.fresh_token, self.fresh_token + length))
        self.fresh_token += length
        self._admit(tokens, reserve)

    @precondition(lambda self: self.model.preempted)
    @rule(index=PICK, reserve=st.integers(0, 2))
    def resume(self, index: int, reserve: int) -> None:
        tokens, adapter = self.model.preempted.pop(index % len(self.model.preempted))
        self._admit(tokens, reserve, adapter)

    @precondition(lambda self: any(s.written < len(s.tokens) for s in self.model.live.values()))
    @rule(index=PICK)
    def prefill(self, index: int) -> None:
        pending = [i for i, s in self.model.live.items() if s.written < len(s.tokens)]
        self._compute(pick(pending, index))

    @precondition(lambda self: self.model.live)
    @rule(index=PICK, token=st.integers(0, 2))
    def decode(self, index: int, token: int) -> None:
        """One step: the pending tokens' KV (a prefill), one more token, growing if needed."""
        seq_id = pick(list(self.model.live), index)
        seq = self.model.live[seq_id]
        if seq.written < len(seq.tokens):
            self._compute(seq_id)
        seq.tokens.append(token)
        cache = self.cache
        before = cache.snapshot()
        needed = cache.blocks_for(len(seq.tokens)) - len(seq.table)
        if not cache.grow(seq_id, len(seq.tokens)):
            assert needed > cache.free_count
            assert cache.snapshot() == before
            gone = self._release(seq_id)
            self.model.preempted.append((gone.tokens, gone.adapter))
            return
        seq.table.extend(cache.table(seq_id, start=len(seq.table)))
        self._check_lru_evictions(before, set())
        self._compute(seq_id)

    @precondition(lambda self: self.model.live)
    @rule(index=PICK, keep=st.integers(0, 30))
    def recommit(self, index: int, keep: int) -> None:
        """Committing a prefix already committed changes nothing."""
        seq_id = pick(list(self.model.live), index)
        seq = self.model.live[seq_id]
        before = self.cache.snapshot()
        self.cache.commit(seq_id, seq.tokens[:min(keep, seq.written)])
        assert self.cache.snapshot() == before

    @precondition(lambda self: self.model.live)
    @rule(index=PICK)
    def preempt(self, index: int) -> None:
        gone = self._release(pick(list(self.model.live), index))
        self.model.preempted.append((gone.tokens, gone.adapter))

    @precondition(lambda self: any(s.written == len(s.tokens) for s in self.model.live.values()))
    @rule(index=PICK)
    def finish(self, index: int) -> None:
        done = [i for i, s in self.model.live.items() if s.written == len(s.tokens)]
        self._release(pick(done, index))

    @precondition(lambda self: self.model.live)
    @rule(index=PICK)
    def cancel(self, index: int) -> None:
        self._release(pick(list(self.model.live), index))

    @precondition(lambda self: self.admissions_since_restart >= 10)
    @rule()
    def restart_shards(self) -> None:
        """Rare (Hypothesis favours rules without arguments): the shards lost their KV."""
        self.admissions_since_restart = 0
        self.cache.clear()
        self.model.live.clear()
        self.model.stored.clear()  # the KV is gone: a stale hit would now fail the model

    # Invariants

    @invariant()
    def blocks_are_free_held_or_cached_exactly_once(self) -> None:
        cache = self.cache
        snap = cache.snapshot()
        everything = set(range(1, cache.total + 1))
        held = set(snap.refs) | set(snap.pins)
        evictable = set(snap.evictable)
        assert len(evictable) == len(snap.evictable)
        assert snap.free | held | evictable == everything
        assert len(snap.free) + len(held) + len(evictable) == cache.total
        assert set(snap.index) - held == evictable
        assert not snap.free & set(snap.index)
        assert set(snap.pins) <= set(snap.index)
        assert cache.free_count == len(snap.free) + len(evictable)
        assert cache.used_count == cache.total - cache.free_count
        assert cache.cached_count == len(snap.index)
        assert len(cache) == len(self.model.live)
        if not self.model.live:
            assert cache.free_count == cache.total
        if not cache.prefix_caching:
            assert not snap.index and not snap.pins

    @invariant()
    def refcounts_match_the_live_tables(self) -> None:
        snap = self.cache.snapshot()
        tables = {i: tuple(s.table) for i, s in self.model.live.items()}
        assert snap.tables == tables
        assert snap.refs == dict(Counter(b for table in tables.values() for b in table))
        assert all(0 not in table and len(set(table)) == len(table) for table in tables.values())

    @invariant()
    def cached_keys_match_the_stored_kv(self) -> None:
        snap = self.cache.snapshot()
        size = self.cache.block_size
        assert len(set(snap.index.values())) == len(snap.index)
        for block, (parent, tokens) in snap.index.items():
            assert len(tokens) == size
            if parent is None or parent < 0:  # a first block: its adapter's root
                prefix: tuple[int, ...] = (0 if parent is None else -parent,)
            else:
                assert parent in snap.index
                last = self.model.stored[parent][-1]
                assert last is not None
                prefix = last
            assert self.model.stored[block] == [prefix + tokens[:slot + 1] for slot in range(size)]

    @invariant()
    def held_chains_and_lru_order_keep_parents_alive(self) -> None:
        snap = self.cache.snapshot()
        held = set(snap.refs) | set(snap.pins)
        order = {block: rank for rank, block in enumerate(snap.evictable)}
        for block, (parent, _) in snap.index.items():
            if parent is None or parent < 0:
                continue
            if block in held:
                assert parent in held
            elif parent in order:
                assert order[parent] > order[block]

    @invariant()
    def the_pool_holds_one_copy(self) -> None:
        """Every held block is in a live table: a sequence that computed a block equal to a
        cached one nobody holds replaces it (the cache adopts its copy), so repeated prompts
        never hold their KV twice."""
        snap = self.cache.snapshot()
        in_tables = {block for seq in self.model.live.values() for block in seq.table}
        assert set(snap.pins) <= set(snap.refs)
        assert self.cache.used_count == len(in_tables)

    @invariant()
    def committed_blocks_stay_cached_and_pins_are_exact(self) -> None:
        if not self.cache.prefix_caching:
            return
        snap = self.cache.snapshot()
        by_key = {key: block for block, key in snap.index.items()}
        size = self.cache.block_size
        pins: Counter[int] = Counter()
        for seq in self.model.live.values():
            parent: int | None = root_key(seq.adapter)
            for position in range(seq.written // size):
                block = by_key[(parent, tuple(seq.tokens[position * size:(position + 1) * size]))]
                if block != seq.table[position]:
                    pins[block] += 1
                parent = block
        assert snap.pins == dict(pins)


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None
)

"""PrefixCache: KV block tables, the exact prefix index, on-demand growth and LRU eviction.

Each behaviour on a hand-built case; test_prefix_cache_machine.py drives random sequences of
them against a model of the shard's KV memory.
"""

from __future__ import annotations

import pytest

from pytgi_router.core.prefix_cache import Admission, PrefixCache, PrefixCacheError


def admit(cache: PrefixCache, seq_id: int, tokens: list[int], reserve: int = 0) -> Admission:
    admission = cache.admit(seq_id, tokens, reserve)
    assert admission is not None
    return admission


def admit_and_commit(cache: PrefixCache, seq_id: int, tokens: list[int]) -> Admission:
    admission = admit(cache, seq_id, tokens)
    cache.commit(seq_id, tokens)
    return admission


def test_block_zero_is_reserved_and_max_blocks_caps_the_pool() -> None:
    cache = PrefixCache(num_blocks=5, block_size=4)
    assert cache.total == 4 and cache.free_count == 4
    assert sorted(admit(cache, 1, list(range(16))).blocks) == [1, 2, 3, 4]
    assert cache.free_count == 0 and cache.used_count == 4
    assert PrefixCache(num_blocks=100, block_size=8, max_blocks=10).total == 10
    with pytest.raises(ValueError):
        PrefixCache(num_blocks=1, block_size=4)
    with pytest.raises(ValueError):
        PrefixCache(num_blocks=4, block_size=0)
    with pytest.raises(ValueError):
        PrefixCache(num_blocks=4, block_size=1, max_blocks=0)


def test_admission_holds_prompt_plus_reserve() -> None:
    cache = PrefixCache(num_blocks=100, block_size=4)
    admission = admit(cache, 1, list(range(5)), reserve=7)
    assert len(admission.blocks) == 3 and admission.cached_tokens == 0
    assert cache.table(1) == admission.blocks
    assert cache.table(1, start=2) == admission.blocks[2:]


def test_a_shared_prefix_hits_the_committed_blocks() -> None:
    cache = PrefixCache(num_blocks=100, block_size=4)
    first = admit_and_commit(cache, 1, list(range(10)))
    second = admit(cache, 2, list(range(8)) + [50, 51, 52])
    assert second.cached_tokens == 8
    assert second.blocks[:2] == first.blocks[:2]
    assert not set(second.blocks[2:]) & set(first.blocks)
    refs = cache.snapshot().refs
    assert refs[first.blocks[0]] == refs[first.blocks[1]] == 2
    assert refs[first.blocks[2]] == 1
    # A different first block: the parent link keeps the second block from matching alone.
    third = admit(cache, 3, [99, 1, 2, 3, 4, 5, 6, 7, 8])
    assert third.cached_tokens == 0


def test_the_last_tokens_block_is_never_a_hit() -> None:
    cache = PrefixCache(num_blocks=100, block_size=4)
    first = admit_and_commit(cache, 1, list(range(8)))
    assert cache.cached_count == 2
    again = admit(cache, 2, list(range(8)))
    assert again.cached_tokens == 4
    assert again.blocks[0] == first.blocks[0] and again.blocks[1] != first.blocks[1]
    assert cache.cached_prefix(list(range(9))) == 8
    assert cache.cached_prefix(list(range(4))) == 0
    assert cache.cached_prefix(list(range(5))) == 4


def test_blocks_are_hittable_only_once_committed() -> None:
    cache = PrefixCache(num_blocks=100, block_size=2)
    tokens = list(range(9))
    admit(cache, 1, tokens)
    assert admit(cache, 2, tokens).cached_tokens == 0
    cache.commit(1, tokens[:5])  # KV of 5 tokens written: 2 full blocks
    assert cache.cached_prefix(tokens) == 4
    cache.commit(1, tokens[:3])  # committing less changes nothing
    assert cache.cached_count == 2
    cache.commit(1, tokens)
    assert cache.cached_prefix(tokens) == 8


def held_once(cache: PrefixCache) -> bool:
    """The pool holds one copy: every held block is in some live table (none is held only
    because a sequence computed an equal one and pinned it)."""
    snap = cache.snapshot()
    in_tables = {block for table in snap.tables.values() for block in table}
    return cache.used_count == len(in_tables) and set(snap.pins) <= set(snap.refs)


def test_a_repeated_prompt_generating_the_same_tokens_holds_one_copy() -> None:
    """The second run of a prompt hits its first block, computes the rest and generates the
    same tokens: its full blocks equal cached ones nobody holds. The cache adopts its own
    (the shard's table stays as it is) and frees the cached copies instead of pinning them."""
    cache = PrefixCache(num_blocks=100, block_size=2)
    prompt, generated = [1, 2, 3], [4, 5, 6, 7]
    first = admit(cache, 1, prompt, reserve=4)
    cache.commit(1, prompt + generated)
    cache.release(1)
    old = cache.snapshot()
    second = admit(cache, 2, prompt, reserve=4)
    assert second.blocks[0] == first.blocks[0] and second.cached_tokens == 2
    cache.commit(2, prompt + generated)
    assert held_once(cache)
    assert cache.used_count == 4 and cache.cached_count == 3
    snap = cache.snapshot()
    assert set(snap.index) == {first.blocks[0], second.blocks[1], second.blocks[2]}
    assert snap.index[second.blocks[2]] == (second.blocks[1], (5, 6))
    assert not {first.blocks[1], first.blocks[2]} & set(snap.index)
    assert {first.blocks[1], first.blocks[2]} <= snap.free
    cache.release(2)
    assert cache.cached_prefix(prompt + generated + [8]) == 6
    assert cache.free_count == cache.total and len(old.index) == cache.cached_count


def test_an_adopted_block_takes_its_cached_children_along() -> None:
    """The first run cached a longer chain than the second has computed yet: the children of
    the copy it replaces hang under its own block, still hittable."""
    cache = PrefixCache(num_blocks=100, block_size=1)
    admit_and_commit(cache, 1, [1, 2, 3, 4])
    cache.release(1)
    third = admit(cache, 3, [1, 2], reserve=1)  # hits 1, computes 2 itself
    cache.commit(3, [1, 2])
    snap = cache.snapshot()
    assert snap.index[third.blocks[1]] == (third.blocks[0], (2,))
    child = next(b for b, key in snap.index.items() if key[1] == (3,))
    assert snap.index[child] == (third.blocks[1], (3,))
    assert cache.cached_prefix([1, 2, 3, 4, 5]) == 4 and held_once(cache)
    cache.release(3)
    assert cache.cached_prefix([1, 2, 3, 4, 5]) == 4


def test_an_identical_block_committed_twice_is_cached_once_and_pinned_while_held() -> None:
    """Two prompts sharing a prefix, both admitted before either committed, each compute their
    blocks (as without caching); the second pins the first's, which the first holds, and caches
    its own next block under them. When the first leaves, the second's own copies replace the
    pinned ones in the index: the pool keeps one copy, and the chain stays hittable."""
    cache = PrefixCache(num_blocks=100, block_size=2)
    tokens = [1, 2, 3, 4, 5]
    first = admit(cache, 1, tokens)
    second = admit(cache, 2, tokens + [6, 7])
    cache.commit(1, tokens)
    cache.commit(2, tokens + [6])  # 3 full blocks: two duplicates of the first's, one new
    snap = cache.snapshot()
    assert set(snap.index) == {first.blocks[0], first.blocks[1], second.blocks[2]}
    assert snap.index[second.blocks[2]] == (first.blocks[1], (5, 6))
    assert snap.pins == {first.blocks[0]: 1, first.blocks[1]: 1}
    assert cache.used_count == 7 and held_once(cache)
    cache.release(1)
    assert held_once(cache) and cache.used_count == 4
    snap = cache.snapshot()
    assert set(snap.index) == set(second.blocks[:3]) and not snap.pins
    assert snap.index[second.blocks[1]] == (second.blocks[0], (3, 4))
    assert set(first.blocks) <= snap.free
    assert cache.cached_prefix(tokens + [6, 7]) == 6
    cache.release(2)
    assert cache.free_count == cache.total
    assert cache.snapshot().evictable == (second.blocks[2], second.blocks[1], second.blocks[0])


def test_release_frees_uncached_blocks_at_once_and_keeps_cached_ones() -> None:
    cache = PrefixCache(num_blocks=10, block_size=2)
    admission = admit(cache, 1, [1, 2, 3], reserve=2)
    cache.commit(1, [1, 2, 3])  # one full block cached; the partial and reserved ones are not
    cache.release(1)
    snap = cache.snapshot()
    assert set(snap.index) == {admission.blocks[0]}
    assert snap.evictable == (admission.blocks[0],)
    assert snap.free == frozenset(range(1, 10)) - {admission.blocks[0]}
    assert cache.free_count == cache.total and cache.used_count == 0
    # An uncommitted sequence leaves nothing behind.
    admit(cache, 2, [7, 8, 9])
    cache.release(2)
    assert cache.cached_count == 1


def test_eviction_is_least_recently_used_and_leaves_first() -> None:
    cache = PrefixCache(num_blocks=11, block_size=1)  # 10 blocks
    chain_a = [1, 2, 3, 4]
    chain_b = [5, 6, 7, 8]
    a = admit_and_commit(cache, 1, chain_a)
    b = admit_and_commit(cache, 2, chain_b)
    cache.release(1)
    cache.release(2)
    # Released children first: each parent is more recent than its children.
    assert cache.snapshot().evictable == a.blocks[::-1] + b.blocks[::-1]
    # A hit on a's first two blocks makes them more recent than b's.
    assert admit(cache, 3, chain_a[:3]).cached_tokens == 2
    cache.release(3)
    assert cache.snapshot().evictable == (a.blocks[3], a.blocks[2]) + b.blocks[::-1] + (
        a.blocks[1], a.blocks[0])
    # Pressure for 4 blocks: the 2 free ones, then a's leaf, then its parent.
    admit(cache, 4, [90, 91, 92, 93])
    assert cache.cached_prefix(chain_a + [0]) == 2
    assert cache.cached_prefix(chain_b + [0]) == 4
    # Next: b's leaf, older than a's remaining blocks (now a leaf too, but recently used).
    admit(cache, 5, [94])
    assert cache.cached_prefix(chain_a + [0]) == 2
    assert cache.cached_prefix(chain_b + [0]) == 3


def test_a_cached_parent_outlives_its_children() -> None:
    # The first sequence caches [p, q] and leaves; the second, admitted at the same time with a
    # longer prompt, computed the same two blocks: its own p2, q2 replace them, and it caches
    # its own child r under q2.
    cache = PrefixCache(num_blocks=8, block_size=1)  # 7 blocks
    first = admit(cache, 1, [1, 2, 3])
    second = admit(cache, 2, [1, 2, 4])
    cache.commit(1, [1, 2])
    cache.release(1)
    assert cache.evictable_count == 2
    cache.commit(2, [1, 2, 4])
    assert cache.evictable_count == 0 and set(first.blocks[:2]) <= cache.snapshot().free
    cache.release(2)
    p, q, r = second.blocks
    assert cache.snapshot().evictable == (r, q, p)
    assert cache.free_count == 7 and cache.evictable_count == 3
    admit(cache, 3, [7, 7, 7, 7])  # the free blocks
    admit(cache, 4, [8])  # evicts r
    assert cache.cached_prefix([1, 2, 4, 0]) == 2
    admit(cache, 5, [9])  # evicts q
    assert cache.cached_prefix([1, 2, 4, 0]) == 1
    assert cache.snapshot().evictable == (p,)


def test_grow_appends_blocks_only_when_needed() -> None:
    cache = PrefixCache(num_blocks=5, block_size=4)
    admit(cache, 1, [1, 2, 3])
    assert cache.grow(1, 4) and len(cache.table(1)) == 1
    assert cache.grow(1, 5) and len(cache.table(1)) == 2
    assert cache.grow(1, 16) and len(cache.table(1)) == 4
    before = cache.snapshot()
    assert not cache.grow(1, 17)
    assert cache.snapshot() == before
    assert cache.grow(1, 3)  # never shrinks
    assert len(cache.table(1)) == 4


def test_grow_evicts_cached_blocks_when_the_free_list_runs_short() -> None:
    cache = PrefixCache(num_blocks=4, block_size=2)  # 3 blocks
    admit_and_commit(cache, 1, [1, 2, 3, 4])
    cache.release(1)
    admit(cache, 2, [9])
    assert cache.free_count == 2
    assert cache.grow(2, 6)
    assert cache.cached_count == 0 and cache.free_count == 0


def test_a_failed_admission_takes_nothing() -> None:
    cache = PrefixCache(num_blocks=5, block_size=2)  # 4 blocks
    admit_and_commit(cache, 1, [1, 2, 3, 4, 5])
    cache.release(1)
    admit(cache, 2, [7, 7])
    before = cache.snapshot()
    # 3 blocks are obtainable; a hit on [1, 2] and [3, 4] still needs 3 fresh ones.
    assert cache.blocks_needed([1, 2, 3, 4, 5], reserve_tokens=5) == 5
    assert cache.admit(3, [1, 2, 3, 4, 5], reserve_tokens=5) is None
    assert cache.snapshot() == before
    assert cache.blocks_needed([1, 2, 3, 4, 5], reserve_tokens=1) == 3
    assert admit(cache, 3, [1, 2, 3, 4, 5], reserve=1).cached_tokens == 4
    assert cache.free_count == 0


def test_blocks_needed_counts_fresh_blocks_and_evictable_hits() -> None:
    cache = PrefixCache(num_blocks=20, block_size=2)
    admit_and_commit(cache, 1, [1, 2, 3, 4, 5])
    assert cache.blocks_needed([1, 2, 3, 4, 5, 6]) == 1  # hits are held, not evictable
    cache.release(1)
    assert cache.blocks_needed([1, 2, 3, 4, 5, 6]) == 3
    free = cache.free_count
    admit(cache, 2, [1, 2, 3, 4, 5, 6])
    assert cache.free_count == free - 3


def test_clear_drops_every_sequence_and_cached_block() -> None:
    cache = PrefixCache(num_blocks=10, block_size=2)
    admit_and_commit(cache, 1, [1, 2, 3, 4, 5])
    admit_and_commit(cache, 2, [1, 2, 3])
    cache.release(2)
    cache.clear()
    assert len(cache) == 0 and 1 not in cache
    assert cache.cached_count == 0 and cache.free_count == cache.total
    assert cache.snapshot().free == frozenset(range(1, 10))
    assert admit(cache, 1, [1, 2, 3, 4, 5]).cached_tokens == 0


def test_caching_off_never_caches_nor_hits() -> None:
    cache = PrefixCache(num_blocks=10, block_size=2, prefix_caching=False)
    admit_and_commit(cache, 1, [1, 2, 3, 4, 5])
    assert cache.cached_count == 0
    assert admit(cache, 2, [1, 2, 3, 4, 5]).cached_tokens == 0
    cache.release(1)
    cache.release(2)
    assert cache.snapshot().free == frozenset(range(1, 10))


def test_bookkeeping_errors_are_raised() -> None:
    cache = PrefixCache(num_blocks=10, block_size=2)
    admit(cache, 1, [1, 2, 3])
    with pytest.raises(PrefixCacheError):
        cache.admit(1, [1], 0)
    with pytest.raises(PrefixCacheError):
        cache.commit(1, [1, 2, 3, 4, 5])  # beyond its 2 blocks
    for call in (lambda: cache.grow(2, 4), lambda: cache.commit(2, [1]),
                 lambda: cache.release(2), lambda: cache.table(2)):
        with pytest.raises(PrefixCacheError):
            call()
    cache.release(1)
    with pytest.raises(PrefixCacheError):
        cache.release(1)
    with pytest.raises(ValueError):
        cache.admit(3, [], 1)
    with pytest.raises(ValueError):
        cache.admit(3, [1], -1)
    assert cache.free_count == cache.total


def test_blocks_cached_under_one_adapter_are_never_hits_for_another() -> None:
    """A prompt's KV depends on its LoRA adapter: the same tokens under adapter 1, adapter 2 and
    the base model share nothing; under the same adapter again they hit."""
    cache = PrefixCache(num_blocks=40, block_size=4)
    prompt = list(range(13))
    first = cache.admit(1, prompt, adapter=1)
    assert first is not None and first.cached_tokens == 0
    cache.commit(1, prompt)
    for seq_id, adapter in ((2, 2), (3, 0)):
        assert cache.cached_prefix(prompt, adapter=adapter) == 0
        other = cache.admit(seq_id, prompt, adapter=adapter)
        assert other is not None and other.cached_tokens == 0
        assert not set(other.blocks) & set(first.blocks)
        cache.commit(seq_id, prompt)
    again = cache.admit(4, prompt, adapter=1)
    assert again is not None and again.cached_tokens == 12
    assert again.blocks[:3] == first.blocks[:3]
    base = cache.admit(5, prompt)
    assert base is not None and base.cached_tokens == 12
    assert not set(base.blocks[:3]) & set(first.blocks)

"""The router's KV block manager: which block each sequence holds, which blocks hold a reusable
prompt prefix, and growing a sequence's blocks as it generates.

The shards own the KV memory, the router owns the bookkeeping (TGI v3 / vLLM style, but in the
router). Block 0 is reserved by the shard (health checks, padding rows), so blocks 1..total are
handed out. A sequence is admitted with blocks for its prompt plus a reserve and grows on demand
at block boundaries; when it cannot grow the scheduler preempts it (release, later re-admit with
every token it has, which then mostly hits its own cached blocks).

Prefix cache: a full block's KV depends on every token before it, so a cached block is keyed
exactly (no hashing, no collisions) by (its parent's block id or None, its own token ids). The
parent link makes the keys a radix tree over block-sized chunks. Blocks enter the index only once
their KV is written (`commit`), never at admission. Unreferenced cached blocks stay cached until
the free list runs short; then the least recently used leaf is evicted first (a child's key names
its parent's id, which must not be reused while the child is cached).

A vision-language prompt's image tokens are keyed by their image's content hash instead of
their (placeholder) ids: `media_keyed`, through `Entry.key_tokens`; those keys hold a 128-bit
hash, the only inexact part.

KV depends on the LoRA adapter a sequence runs under as well as on its tokens, so a first block's
key names its adapter instead of a parent (`root_key`): None for the base model, -i for adapter
i (block ids are positive), and the chains of different adapters never meet.

A sequence computes a block equal to a cached one when its prompt repeats one whose last block
was never a hit, or when it generates the tokens an earlier run did. Its table keeps its own copy
(the shard has that table, and tables never change under the shard). When no table holds the
cached copy, the cache adopts the sequence's block in its place (the same key; the copy's cached
children hang under it now) and frees the copy. When another live table holds it, the sequence
"pins" it: its later blocks are registered under that chain, as a second run would compute them
without caching; and when the last table holding a pinned block lets go, a pinner's own copy is
adopted the same way. So the pool never holds a block no live table uses: a repeated prompt costs
its KV once, not once for it and once more for the cached run it equals.

Invariant: every ancestor of a held (referenced or pinned) cached block is held too, so the
unheld cached blocks are whole evictable subtrees, kept in LRU order with parents after children;
the oldest one is therefore always a leaf and eviction is O(1). A pinned block is always
referenced too.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeGuard

# (parent block id, or for a first block its root: None for the base model, -i for LoRA adapter
# i; the block's token ids)
BlockKey = tuple[int | None, tuple[int, ...]]


def media_keyed(tokens: Sequence[int], spans: Sequence[tuple[int, int, bytes]]) -> list[int]:
    """A prompt with images as the cache keys it: each image's span of (identical) image tokens
    replaced by its content hash as one negative number, which no token id is. KV at and after
    an image depends on the image's pixels, not on its placeholder tokens: keyed by the
    hash, two prompts share those blocks only when their images are the same, while the blocks
    before the first image still match the same text without images. `spans`: (offset, count,
    content hash) per image."""
    out = list(tokens)
    for offset, count, digest in spans:
        out[offset:offset + count] = [-1 - int.from_bytes(digest, "big")] * count
    return out


def span_keyed(keys: Sequence[int], spans: Sequence[tuple[int, int]]) -> list[int]:
    """Prompt keys with each bidirectional span's tokens (PaliGemma's prompt, Gemma 3's images)
    keyed by the whole span's content and their place in it, as negative numbers no token id
    is: a span's KV depends on every token of it, later ones included, so two prompts share a
    block inside a span only when the whole span is the same; a cache hit ending inside a span
    then holds exactly the KV this prompt's span gives. The blocks before a span still match."""
    out = list(keys)
    for lo, hi in spans:
        digest = hashlib.blake2b(repr(out[lo:hi]).encode(), digest_size=16).digest()
        base = -(1 << 130) - int.from_bytes(digest, "big") * (hi - lo + 1)
        out[lo:hi] = [base - i for i in range(hi - lo)]
    return out


def root_key(adapter: int) -> int | None:
    """A first block's parent in its key: its adapter's root (None: the base model)."""
    return None if adapter == 0 else -adapter


def _is_block(parent: int | None) -> TypeGuard[int]:
    """Whether a key's parent is a block (not a root)."""
    return parent is not None and parent > 0


class PrefixCacheError(RuntimeError):
    """A bookkeeping bug (unknown or duplicate sequence, KV beyond a table): never a client's."""


@dataclass(frozen=True)
class Admission:
    """An admitted sequence's block table and how many of its first tokens are already cached
    (the `cache_len` the shard skips computing: always whole blocks, never the last token)."""

    blocks: tuple[int, ...]
    cached_tokens: int


@dataclass(frozen=True)
class PrefixCacheSnapshot:
    """A copy of the whole state, for tests and debugging (O(total) to build)."""

    free: frozenset[int]
    refs: dict[int, int]  # held blocks: sequences whose table holds them
    pins: dict[int, int]  # cached blocks: sequences relying on them with their own copy
    index: dict[int, BlockKey]  # cached block -> its key
    evictable: tuple[int, ...]  # unheld cached blocks, least recently used first
    tables: dict[int, tuple[int, ...]]


@dataclass(slots=True)
class _Sequence:
    table: list[int]
    # The cached block standing for each committed full block of the sequence: its own table
    # block, or the identical block cached first by someone else (then pinned).
    chain: list[int]
    # Its first block's parent in the keys: its adapter's root (root_key).
    root: int | None = None


class PrefixCache:
    """KV blocks of the running sequences plus the prefix cache over them."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_blocks: int | None = None,
        prefix_caching: bool = True,
    ) -> None:
        """`num_blocks` counts block 0; `max_blocks` optionally caps how many of the others the
        router may use (a KV token budget smaller than the shard's cache)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (block 0 is reserved), "
                             f"got {num_blocks}")
        usable = num_blocks - 1 if max_blocks is None else min(num_blocks - 1, max_blocks)
        if usable < 1:
            raise ValueError(f"no usable KV blocks (num_blocks={num_blocks}, "
                             f"max_blocks={max_blocks})")
        self.block_size = block_size
        self.total = usable
        self.prefix_caching = prefix_caching
        self._reset()

    def _reset(self) -> None:
        usable = self.total
        # A stack: the lowest ids are handed out first, which keeps tables readable in logs.
        self._free: list[int] = list(range(usable, 0, -1))
        self._refs = [0] * (usable + 1)
        # Cached block -> the sequences pinning it; cached block -> its cached children.
        self._pinners: dict[int, set[int]] = {}
        self._children: dict[int, set[int]] = {}
        self._index: dict[BlockKey, int] = {}
        self._keys: dict[int, BlockKey] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._seqs: dict[int, _Sequence] = {}

    # Introspection

    @property
    def free_count(self) -> int:
        """Blocks a new admission or growth can get: free plus evictable cached ones."""
        return len(self._free) + len(self._lru)

    @property
    def used_count(self) -> int:
        """Blocks held by live sequences (directly or as a pinned prefix)."""
        return self.total - self.free_count

    @property
    def cached_count(self) -> int:
        """Blocks in the prefix index, held or not."""
        return len(self._index)

    @property
    def evictable_count(self) -> int:
        return len(self._lru)

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def blocks_for(self, tokens: int) -> int:
        """Blocks needed to hold `tokens` tokens of KV."""
        return -(-tokens // self.block_size)

    def table(self, seq_id: int, start: int = 0) -> tuple[int, ...]:
        """The sequence's block table from position `start` (O(blocks returned), so a caller
        can fetch just what `grow` appended)."""
        return tuple(self._sequence(seq_id).table[start:])

    def cached_prefix(self, tokens: Sequence[int], reuse: bool = True, adapter: int = 0) -> int:
        """The `cached_tokens` an admission of `tokens` would get now (changes nothing)."""
        return len(self._match(tokens, reuse, adapter)) * self.block_size

    def blocks_needed(
        self, tokens: Sequence[int], reserve_tokens: int = 0, reuse: bool = True, adapter: int = 0
    ) -> int:
        """How much `admit(tokens, reserve_tokens, reuse)` would take out of `free_count` now:
        fresh blocks plus the cache hits that are evictable today. It succeeds iff this is at
        most `free_count`."""
        matched = self._match(tokens, reuse, adapter)
        lru = self._lru
        fresh = self.blocks_for(len(tokens) + reserve_tokens) - len(matched)
        return fresh + sum(1 for block in matched if block in lru)

    def snapshot(self) -> PrefixCacheSnapshot:
        return PrefixCacheSnapshot(
            free=frozenset(self._free),
            refs={b: n for b, n in enumerate(self._refs) if n},
            pins={b: len(seqs) for b, seqs in self._pinners.items()},
            index=dict(self._keys),
            evictable=tuple(self._lru),
            tables={s: tuple(seq.table) for s, seq in self._seqs.items()},
        )

    # Life of a sequence

    def admit(
        self, seq_id: int, tokens: Sequence[int], reserve_tokens: int = 0, reuse: bool = True,
        adapter: int = 0,
    ) -> Admission | None:
        """Blocks for `tokens` plus `reserve_tokens` more, reusing the longest cached prefix of
        `tokens` except the block of its last token (its logits must be computed, and a shared
        block is never written). `reuse=False` takes no cached block (a request that wants
        every prompt token's logprob computes them all). None, taking nothing, when too few
        blocks are free even after evicting."""
        if seq_id in self._seqs:
            raise PrefixCacheError(f"sequence {seq_id} is already admitted")
        if not tokens:
            raise ValueError("cannot admit a sequence without tokens")
        if reserve_tokens < 0:
            raise ValueError(f"reserve_tokens must be >= 0, got {reserve_tokens}")
        matched = self._match(tokens, reuse, adapter)
        fresh = self.blocks_for(len(tokens) + reserve_tokens) - len(matched)
        lru = self._lru
        evictable_hits = sum(1 for block in matched if block in lru)
        if fresh + evictable_hits > len(self._free) + len(lru):
            return None
        refs = self._refs
        for block in matched:
            # Held before `_take` evicts, so a hit can never be evicted under itself.
            refs[block] += 1
            lru.pop(block, None)
        table = matched + self._take(fresh)
        self._seqs[seq_id] = _Sequence(table, list(matched), root_key(adapter))
        return Admission(tuple(table), len(matched) * self.block_size)

    def grow(self, seq_id: int, tokens: int) -> bool:
        """Makes the sequence's table hold `tokens` tokens; False, taking nothing, when too few
        blocks are free even after evicting. O(new blocks)."""
        seq = self._sequence(seq_id)
        count = self.blocks_for(tokens) - len(seq.table)
        if count <= 0:
            return True
        if count > len(self._free) + len(self._lru):
            return False
        seq.table.extend(self._take(count))
        return True

    def commit(self, seq_id: int, tokens: Sequence[int]) -> None:
        """After a step: `tokens` are all of the sequence's token ids whose KV is now written in
        its blocks (prompt and generated). Every newly completed full block becomes hittable; one
        identical to a block cached already is not registered twice: the cache adopts it in
        place of the cached copy when no table holds that copy, otherwise the sequence pins the
        copy (its next blocks are registered under it). O(new full blocks, and the children of
        an adopted copy)."""
        seq = self._sequence(seq_id)
        size = self.block_size
        if len(tokens) > len(seq.table) * size:
            raise PrefixCacheError(f"sequence {seq_id}: KV of {len(tokens)} tokens committed into "
                                   f"{len(seq.table)} blocks of {size}")
        chain = seq.chain
        full = len(tokens) // size
        if not self.prefix_caching or full <= len(chain):
            return
        index = self._index
        parent = chain[-1] if chain else seq.root
        for position in range(len(chain), full):
            key = (parent, tuple(tokens[position * size:(position + 1) * size]))
            own = seq.table[position]
            block = index.get(key)
            if block is None:
                self._register(key, own)
                block = own
            elif block != own:
                if self._refs[block]:
                    self._pinners.setdefault(block, set()).add(seq_id)
                else:
                    self._adopt(block, own, position)
                    block = own
            chain.append(block)
            parent = block

    def release(self, seq_id: int) -> None:
        """Finish, cancel or preempt: drops the sequence's blocks. Cached ones stay cached (most
        recently used, parents after children); the others are free at once."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise PrefixCacheError(f"sequence {seq_id} is not admitted")
        table, chain = seq.table, seq.chain
        refs = self._refs
        # Deepest first, so each parent lands in the LRU order after its children.
        for position in range(len(table) - 1, -1, -1):
            if position < len(chain) and chain[position] != table[position]:
                self._unpin(chain[position], seq_id)
            block = table[position]
            refs[block] -= 1
            if refs[block]:
                continue
            pinners = self._pinners.get(block)
            if pinners:
                # The last table holding it let go: a pinner's own copy takes its place.
                self._adopt(block, self._seqs[min(pinners)].table[position], position)
            elif block in self._keys:
                self._lru[block] = None
            else:
                self._free.append(block)

    def clear(self) -> None:
        """The shards restarted: their KV is gone, so is every sequence and cached block."""
        self._reset()

    # Internals

    def _sequence(self, seq_id: int) -> _Sequence:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise PrefixCacheError(f"sequence {seq_id} is not admitted")
        return seq

    def _match(self, tokens: Sequence[int], reuse: bool = True, adapter: int = 0) -> list[int]:
        """The cached chain of `tokens`' full blocks under `adapter`, never including its last
        token's block."""
        if not (self.prefix_caching and reuse):
            return []
        size = self.block_size
        index = self._index
        matched: list[int] = []
        parent = root_key(adapter)
        for position in range((len(tokens) - 1) // size):
            block = index.get((parent, tuple(tokens[position * size:(position + 1) * size])))
            if block is None:
                break
            matched.append(block)
            parent = block
        return matched

    def _register(self, key: BlockKey, block: int) -> None:
        """Makes a sequence's freshly written full block hittable under `key`."""
        self._index[key] = block
        self._keys[block] = key
        parent = key[0]
        if _is_block(parent):
            self._children.setdefault(parent, set()).add(block)

    def _unpin(self, block: int, seq_id: int) -> None:
        """The sequence no longer relies on the cached `block` (it is leaving)."""
        pinners = self._pinners[block]
        pinners.discard(seq_id)
        if not pinners:
            del self._pinners[block]
            if not self._refs[block]:  # never while the invariant holds: a safe fallback
                self._lru[block] = None

    def _adopt(self, copy: int, own: int, position: int) -> None:
        """`own`, a live sequence's block at `position` holding the KV the cached `copy` holds
        (no table holds `copy`), replaces it in the index: its key, its cached children (their
        keys name their parent) and its pinners, whose chains now go through `own`; `copy` is
        free. The sequence that holds `own` stops pinning `copy` if it did."""
        key = self._keys.pop(copy)
        self._register(key, own)
        parent = key[0]
        if _is_block(parent):
            self._children[parent].discard(copy)
        children = self._children.pop(copy, None)
        if children:
            self._rekey_children(children, own)
        pinners = self._pinners.pop(copy, None)
        if pinners:
            self._move_pinners(pinners, own, position)
        self._lru.pop(copy, None)
        self._free.append(copy)

    def _rekey_children(self, children: set[int], parent: int) -> None:
        """Cached `children` hang under `parent` now (same tokens, a new parent id)."""
        index, keys = self._index, self._keys
        for child in children:
            _, tokens = keys[child]
            del index[keys[child]]
            index[(parent, tokens)] = child
            keys[child] = (parent, tokens)
        self._children[parent] = children

    def _move_pinners(self, pinners: set[int], own: int, position: int) -> None:
        """The sequences pinning an adopted copy pin `own` instead, except its holder."""
        seqs = self._seqs
        for seq_id in pinners:
            seqs[seq_id].chain[position] = own
        rest = {s for s in pinners if seqs[s].table[position] != own}
        if rest:
            self._pinners[own] = rest

    def _take(self, count: int) -> list[int]:
        """`count` blocks for one sequence (the caller checked they exist), each referenced once."""
        free = self._free
        while len(free) < count:
            free.append(self._evict())
        if not count:
            return []
        blocks = free[-count:]
        del free[-count:]
        blocks.reverse()
        refs = self._refs
        for block in blocks:
            refs[block] = 1
        return blocks

    def _evict(self) -> int:
        """Drops the least recently used unheld cached block from the index and returns it."""
        block, _ = self._lru.popitem(last=False)
        if self._children.get(block):
            raise PrefixCacheError(f"block {block} was evicted before its cached children")
        key = self._keys.pop(block)
        del self._index[key]
        parent = key[0]
        if _is_block(parent):
            siblings = self._children[parent]
            siblings.discard(block)
            if not siblings:
                del self._children[parent]
        return block

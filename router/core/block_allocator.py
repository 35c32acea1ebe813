"""The router's view of the shards' paged KV cache: which block belongs to which request.

The shards own the memory, the router owns the bookkeeping. Block 0 is reserved by the shard
(health checks, padding), so the allocator hands out blocks 1..num_blocks-1 only. Every request
gets, when it is admitted into a batch, enough blocks for its prompt plus all of its new tokens,
so a running request can never run out of KV space mid-generation.
"""

from __future__ import annotations


class BlockAllocatorError(RuntimeError):
    """A bookkeeping bug (double free, foreign block): never caused by a client."""


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int, max_blocks: int | None = None) -> None:
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
        # A stack: the lowest ids are handed out first, which keeps allocations readable in logs.
        self._free: list[int] = list(range(usable, 0, -1))
        self._used = bytearray(usable + 1)

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def used_count(self) -> int:
        return self.total - len(self._free)

    def blocks_for(self, tokens: int) -> int:
        """Blocks needed to hold `tokens` tokens of KV."""
        return -(-tokens // self.block_size)

    def allocate(self, tokens: int) -> list[int] | None:
        """Blocks for `tokens` tokens, or None (nothing taken) when too few are free."""
        if tokens < 1:
            raise ValueError(f"cannot allocate KV for {tokens} tokens")
        count = self.blocks_for(tokens)
        if count > len(self._free):
            return None
        free = self._free
        blocks = free[-count:]
        del free[-count:]
        blocks.reverse()
        used = self._used
        for block in blocks:
            used[block] = 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Returns `blocks` to the pool; raises (and frees nothing) on a double or foreign free."""
        used = self._used
        seen: set[int] = set()
        for block in blocks:
            if not 0 < block <= self.total or not used[block] or block in seen:
                raise BlockAllocatorError(f"block {block} is not allocated")
            seen.add(block)
        for block in blocks:
            used[block] = 0
        self._free.extend(reversed(blocks))

    def is_allocated(self, block: int) -> bool:
        return 0 < block <= self.total and bool(self._used[block])

"""The FIFO of requests waiting for a batch, and the admission rule that forms the next batch.

Admission never over-commits the KV cache: an entry leaves the queue only with the blocks for its
prompt and all of its new tokens. The queue is strictly first-in first-out (no entry overtakes a
waiting one), like TGI's: a large request at the head waits for room instead of starving.
"""

from __future__ import annotations

from pytgi_router.core.block_allocator import BlockAllocator
from pytgi_router.core.request import Entry


class Queue:
    def __init__(self, allocator: BlockAllocator) -> None:
        self.allocator = allocator
        # Insertion-ordered: O(1) removal of a cancelled entry, FIFO iteration for admission.
        self._entries: dict[int, Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, entry_id: int) -> bool:
        return entry_id in self._entries

    def append(self, entry: Entry) -> None:
        self._entries[entry.id] = entry

    def remove(self, entry_id: int) -> Entry | None:
        return self._entries.pop(entry_id, None)

    def drain(self) -> list[Entry]:
        """Empties the queue (shutdown); the entries hold no blocks."""
        entries = list(self._entries.values())
        self._entries.clear()
        return entries

    def next_batch(
        self,
        min_size: int | None,
        max_size: int | None,
        prefill_token_budget: int,
        token_budget: int,
    ) -> list[Entry] | None:
        """Takes entries from the front while they fit; None (queue untouched) if fewer than
        `min_size` (or none at all) fit.

        Fits = the sum of prompt lengths stays within `prefill_token_budget`, the KV tokens
        reserved (whole blocks) within `token_budget`, the blocks in the allocator, and the count
        within `max_size`. Cancelled entries met on the way are dropped.
        """
        if not self._entries or (max_size is not None and max_size <= 0):
            return None
        if prefill_token_budget <= 0 or token_budget <= 0:
            return None
        if min_size is not None and len(self._entries) < min_size:
            return None
        batch, cancelled = self._take(max_size, prefill_token_budget, token_budget)
        for entry in cancelled:
            del self._entries[entry.id]
        if not batch or (min_size is not None and len(batch) < min_size):
            for entry in batch:
                self._release(entry)
            return None
        for entry in batch:
            del self._entries[entry.id]
        return batch

    def _take(
        self, max_size: int | None, prefill_budget: int, token_budget: int
    ) -> tuple[list[Entry], list[Entry]]:
        """(entries that fit, holding blocks; cancelled entries met on the way)."""
        allocator = self.allocator
        block_size = allocator.block_size
        batch: list[Entry] = []
        cancelled: list[Entry] = []
        prefill_tokens = 0
        reserved_tokens = 0
        for entry in self._entries.values():
            if entry.stream.cancelled:
                cancelled.append(entry)
                continue
            prompt = len(entry.request.input_ids)
            reserve = allocator.blocks_for(entry.total_tokens) * block_size
            if prefill_tokens + prompt > prefill_budget:
                break
            if reserved_tokens + reserve > token_budget:
                break
            blocks = allocator.allocate(entry.total_tokens)
            if blocks is None:
                break
            entry.blocks = blocks
            batch.append(entry)
            prefill_tokens += prompt
            reserved_tokens += reserve
            if max_size is not None and len(batch) >= max_size:
                break
        return batch, cancelled

    def _release(self, entry: Entry) -> None:
        if entry.blocks is not None:
            self.allocator.free(entry.blocks)
            entry.blocks = None

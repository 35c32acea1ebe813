"""The shard's live batches, by id, between the router's calls."""

from __future__ import annotations

from collections.abc import Sequence

from pytgi_shard.engine.batch import Batch
from pytgi_shard.errors import BatchNotFound


class BatchCache:
    def __init__(self) -> None:
        self._batches: dict[int, Batch] = {}

    def __len__(self) -> int:
        return len(self._batches)

    def __contains__(self, batch_id: object) -> bool:
        return batch_id in self._batches

    def get(self, batch_id: int) -> Batch:
        batch = self._batches.get(batch_id)
        if batch is None:
            raise BatchNotFound(batch_id)
        return batch

    def pop(self, batch_id: int) -> Batch:
        batch = self._batches.pop(batch_id, None)
        if batch is None:
            raise BatchNotFound(batch_id)
        return batch

    def pop_all(self, batch_ids: Sequence[int]) -> list[Batch]:
        """Pops every listed batch, or none of them when one is missing."""
        missing = [i for i in batch_ids if i not in self._batches]
        if missing:
            raise BatchNotFound(missing[0])
        return [self._batches.pop(i) for i in batch_ids]

    def set(self, batch: Batch | None) -> None:
        """Stores a batch that still has requests; None (every request finished) stores nothing."""
        if batch is not None and len(batch) > 0:
            self._batches[batch.batch_id] = batch

    def adapters(self) -> frozenset[int]:
        """The LoRA adapters (wire indices) with rows in the live batches: never evicted."""
        return frozenset(r.adapter_index for b in self._batches.values() for r in b.requests)

    def delete(self, batch_id: int) -> None:
        self._batches.pop(batch_id, None)

    def clear(self) -> None:
        self._batches.clear()

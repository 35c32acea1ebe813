"""The LoRA adapters the router serves, by name: what `adapter_id` and OpenAI's `model` resolve
against, kept in step with the shards' (start-up ones from Info, live ones as
/v1/load_lora_adapter and /v1/unload_lora_adapter change them).

Each adapter has a wire index (a Request's adapter_index: i > 0 is the shards' adapter i) and a
load key, unique for the life of the process: the prefix cache keys a sequence's blocks by the
key (prefix_cache.root_key), so an adapter loaded later under the same name or at the same index
never meets the blocks an unloaded one computed. An index is free for a new load only once the
shards have unloaded the old adapter, which waits for its requests in flight to end.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import count

# How often an unload waiting for requests in flight looks again (s).
IDLE_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class AdapterRef:
    """One loaded adapter: its name, wire index, load key and (live loads) where it came from."""

    name: str
    index: int
    key: int
    # The lora_path of a live load (replayed on shards that restart); None: --lora-adapters.
    source: str | None = None


class AdapterTable:
    def __init__(self, names: Sequence[str] = (), max_loras: int = 0,
                 runtime_updates: bool = False) -> None:
        self.max_loras = max_loras
        self.runtime_updates = runtime_updates
        self._keys = count(1)
        self._by_name: dict[str, AdapterRef] = {}
        # Indices taken by no loaded adapter yet not free: a load in progress, or an unloaded
        # adapter whose requests in flight have not all ended.
        self._reserved: set[int] = set()
        # Requests submitted and not yet out of the scheduler (its queue or running batch), per
        # wire index; and each such request's index, by entry id (a leave is idempotent).
        self._in_flight: Counter[int] = Counter()
        self._members: dict[int, int] = {}
        for index, name in enumerate(names, 1):
            if name:
                self._by_name[name] = AdapterRef(name, index, next(self._keys))

    def get(self, name: str) -> AdapterRef | None:
        return self._by_name.get(name)

    def by_index(self, index: int) -> AdapterRef | None:
        return next((r for r in self._by_name.values() if r.index == index), None)

    def names(self) -> list[str]:
        """The loaded adapters' names, by wire index."""
        return [r.name for r in sorted(self._by_name.values(), key=lambda r: r.index)]

    def current(self, index: int, key: int) -> bool:
        """Whether the adapter loaded at `index` is the load `key` names."""
        ref = self.by_index(index)
        return ref is not None and ref.key == key

    def refs(self) -> list[AdapterRef]:
        return sorted(self._by_name.values(), key=lambda r: r.index)

    def reserve(self) -> int:
        """The lowest free wire index, reserved for a load until `add` or `release`."""
        taken = {r.index for r in self._by_name.values()} | self._reserved
        index = next(i for i in count(1) if i not in taken)
        self._reserved.add(index)
        return index

    def add(self, name: str, index: int, source: str) -> AdapterRef:
        """A load the shards accepted at `index` (reserved): selectable from now on."""
        self._reserved.discard(index)
        ref = self._by_name[name] = AdapterRef(name, index, next(self._keys), source)
        return ref

    def remove(self, name: str) -> AdapterRef | None:
        """Unselectable from now on (new requests for it are refused); its index stays reserved
        until `release`."""
        ref = self._by_name.pop(name, None)
        if ref is not None:
            self._reserved.add(ref.index)
        return ref

    def release(self, index: int) -> None:
        self._reserved.discard(index)

    def enter(self, entry_id: int, index: int) -> None:
        """Request `entry_id` runs under `index` (0, the base model, is not counted)."""
        if index and entry_id not in self._members:
            self._members[entry_id] = index
            self._in_flight[index] += 1

    def leave(self, entry_id: int) -> None:
        """Request `entry_id` is out of the scheduler; a second leave does nothing."""
        index = self._members.pop(entry_id, 0)
        if index:
            self._in_flight[index] -= 1
            if not self._in_flight[index]:
                del self._in_flight[index]

    def in_flight(self, index: int) -> int:
        return self._in_flight[index]

    async def until_idle(self, index: int) -> None:
        """Returns once no request submitted under `index` is in flight: none queued, none in
        the running batch (a cancelled one stays there until the scheduler retires it)."""
        while self._in_flight[index]:
            await asyncio.sleep(IDLE_POLL_S)

"""Which LoRA adapters sit in the device's slots (--max-loras), S-LoRA's way: every loaded
adapter keeps its weights in host memory; the device holds at most `slots` of them, and an
adapter a step needs that is not there takes a free slot or the slot of the least recently used
adapter that no live row uses (evicted: only its host copy remains). The router never sends a
step that needs more than `slots` distinct adapters (router/core/adapter_cap.py), so a victim
always exists; if one does not, the step is refused rather than run with wrong weights.

`SlotTable` is the policy, plain Python (unit-tested with hypothesis); `write_slot` is the one
place that writes a slot of every wrapped layer (LoraLinear.set_slot), so that start-up, live
loads, evictions and reloads all go through it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

import torch

from pytgi_shard.lora.attach import Sites

# Fused (A, B) per wrapped layer, None where the adapter adapts none of its pieces (attach.fuse).
Pairs = Sequence[tuple[torch.Tensor, torch.Tensor] | None]


class SlotsExhausted(ValueError):
    """A step needs more distinct adapters than the device holds (a router that did not respect
    --max-loras)."""


@dataclass(frozen=True, slots=True)
class Move:
    """Copy adapter `index` (its wire index) into device slot `slot`; `evicted` is the adapter
    that held the slot before (None: the slot was free)."""

    index: int
    slot: int
    evicted: int | None


class SlotTable:
    """Wire index -> device slot (1..slots) of the resident adapters, least recently used first."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._lru: OrderedDict[int, int] = OrderedDict()

    def slot_of(self, index: int) -> int | None:
        return self._lru.get(index)

    def resident(self) -> list[int]:
        """Resident adapters' wire indices, least recently used first."""
        return list(self._lru)

    def place(self, needed: Iterable[int], busy: Collection[int] = ()) -> list[Move]:
        """Makes every adapter of `needed` (wire indices > 0) resident and most recently used;
        the moves to carry out, in order. A victim is the least recently used resident adapter
        neither needed nor `busy` (rows in the shard's live batches). SlotsExhausted when none
        is left; the table is then unchanged."""
        want = list(dict.fromkeys(i for i in needed if i > 0))
        protected = set(want) | set(busy)
        missing = [i for i in want if i not in self._lru]
        free = sorted(set(range(1, self.slots + 1)) - set(self._lru.values()))
        victims = [i for i in self._lru if i not in protected]
        if len(missing) > len(free) + len(victims):
            raise SlotsExhausted(f"a step needs {len(protected)} LoRA adapters resident at "
                                 f"once, more than --max-loras {self.slots}")
        moves = []
        for index in missing:
            if free:
                moves.append(Move(index, free.pop(0), None))
            else:
                victim = victims.pop(0)
                moves.append(Move(index, self._lru.pop(victim), victim))
            self._lru[index] = moves[-1].slot
        for index in want:
            self._lru.move_to_end(index)
        return moves

    def drop(self, index: int) -> int | None:
        """Forgets adapter `index` (unloaded); the slot it held, now free, or None."""
        return self._lru.pop(index, None)


def write_slot(sites: Sites, slot: int, pairs: Pairs | None) -> None:
    """Writes an adapter's pairs into device slot `slot` of every wrapped layer, or clears the
    slot (None). The one write path (LoraLinear.set_slot): layers the adapter does not adapt get
    their slot cleared, so nothing of a previous tenant remains."""
    for i, site in enumerate(sites.sites):
        pair = None if pairs is None else pairs[i]
        if pair is None:
            site.lora.set_slot(slot, None, None)
        else:
            site.lora.set_slot(slot, pair[0], pair[1])

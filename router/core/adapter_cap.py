"""The --max-loras cap on a step: the shards hold at most `max_loras` LoRA adapters on the device
at once (shard/lora/residency.py), and every adapter with a row in a step must be there. So the
scheduler admits a newcomer only if its adapter is already among the live entries' or one more
still fits; otherwise it waits at the head of the queue (FIFO, as for blocks) until a live
adapter's last request ends. Pure policy, no I/O."""

from __future__ import annotations

from collections.abc import Collection, Iterable

from pytgi_router.core.request import Entry


def live_adapters(entries: Iterable[Entry]) -> set[int]:
    """The LoRA adapters (wire indices, 0 excluded) of `entries`."""
    return {e.request.adapter_index for e in entries} - {0}


def fits_adapter_cap(present: Collection[int] | None, adapter: int, max_loras: int) -> bool:
    """Whether a request under `adapter` (0: the base model, which takes no slot) may join a
    step whose live entries use the adapters `present` (None: not tracked, no cap) without
    needing more than `max_loras` distinct adapters (0: the shards serve none, so no cap to
    keep: validation already refuses any adapter)."""
    if present is None or adapter == 0 or max_loras <= 0 or adapter in present:
        return True
    return len(present) < max_loras

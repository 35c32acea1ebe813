"""Cutting a multi-step Decode call short (the CutShort RPC): a newcomer waits to join, so the
call stops after the step it is on instead of running all its steps.

The router names the call by `DecodeRequest.call_id`; the service sets the flag on its event
loop while the engine thread runs the call (shard/service/server.py), and the loop of
shard/engine/multi_step.py reads it between steps. With one rank the flag is read as it is.
With several, every rank must run the same number of steps (each step's forward holds
collectives), yet each receives the CutShort at its own moment: the ranks agree before each
further step with a one-element all-reduce of the flag (any rank flagged: all stop). That
costs one small collective per step after the first, and only for calls of several steps on
several ranks.

One flag slot is enough: the router sends at most one CutShort per call and a call's CutShort
is sent before the next call starts. A CutShort that comes after its call ended (or before it
began on this rank) stays in the slot; it matches no other call, since call ids are unique per
router (a restarted router's ids restart, so a stale id could at worst cut one call short:
its tokens stay right).
"""

from __future__ import annotations

import torch

from pytgi_shard.device.distributed import Dist


class CutShort:
    """The call id the router last asked to stop (0: none)."""

    def __init__(self) -> None:
        # Written by the service's event loop, read by the engine thread: one int, set whole.
        self.requested = 0

    def request(self, call_id: int) -> None:
        """CutShort(call_id): that call stops after its current step."""
        self.requested = call_id

    def reset(self) -> None:
        """Forgets a pending request (ClearCache of every batch: the router starts over)."""
        self.requested = 0

    def wanted(self, call_id: int) -> bool:
        """Whether this rank was asked to stop call `call_id` (0: a call that cannot be cut)."""
        return call_id != 0 and self.requested == call_id

    def agreed(self, call_id: int, dist: Dist) -> bool:
        """Whether every rank stops `call_id` here: this rank's flag alone on one rank; with
        several, any rank's flag (all-reduced), so every rank answers the same."""
        if call_id == 0:  # the same on every rank: no collective
            return False
        local = self.wanted(call_id)
        if dist.world_size == 1:
            return local
        flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=dist.device)
        return bool(dist.all_reduce(flag).item())

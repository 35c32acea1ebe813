"""Cutting a multi-step Decode call short for a newcomer or a cancel (the router's side of
CutShort).

A Decode call of k steps (router/core/decode_steps.py) runs in the shards while the router
waits. A request admitted to the queue meanwhile would wait for the call's last step; instead
the router sends CutShort with the call's id to every rank, the shards stop after the step they
are on (shard/engine/cut_short.py) and answer the steps done (`step_sizes`), routed as any
answer; the next call then prefills the newcomer. So k can be large without a newcomer paying
up to k - 1 steps of TTFT. A running request cancelled meanwhile cuts the call short too: it
would compute to the call's end for nobody, holding its blocks.

At most one CutShort per call, sent without blocking the submit that triggered it; its failure
only means the call runs to its end (the call itself reports a lost shard).
"""

from __future__ import annotations

import asyncio
import logging

from pytgi_router.core.decode_steps import cut_short_wanted
from pytgi_router.core.shard_client import ShardClient
from pytgi_router.core.step_plan import Budgets

logger = logging.getLogger(__name__)

# A CutShort is answered at once by a live shard (on its event loop, not behind the call).
CUT_SHORT_TIMEOUT_S = 5.0


class CallCutter:
    """The multi-step call in flight (if any) and whether it was cut short."""

    def __init__(self, client: ShardClient, budgets: Budgets) -> None:
        self.client = client
        self.budgets = budgets
        self._next_id = 1
        # The call in flight that may still be cut short, and the scheduler's
        # steps-since-admission count when it was planned; None between calls or once sent.
        self._cuttable: tuple[int, int] | None = None
        # CutShort RPCs in flight (kept referenced until done).
        self._sending: set[asyncio.Task[None]] = set()

    def open(self, steps: int, steps_since_admission: int) -> int:
        """A Decode call of `steps` steps starts: its call id (0 for one step: nothing to cut)."""
        if steps <= 1:
            return 0
        call_id = self._next_id
        self._next_id += 1
        self._cuttable = (call_id, steps_since_admission)
        return call_id

    def close(self) -> None:
        """The call ended (answered or failed): a newcomer from now on finds no call to cut."""
        self._cuttable = None

    def newcomer(self, running: int, waiting: int) -> bool:
        """A request joined the queue: cuts the call in flight short when it may join
        (`cut_short_wanted`); True when a CutShort was sent."""
        cuttable = self._cuttable
        if cuttable is None:
            return False
        call_id, since = cuttable
        if not cut_short_wanted(self.budgets, running, waiting, since):
            return False
        self._cut(call_id)
        return True

    def cancelled(self) -> bool:
        """A running request was cancelled: cuts the call in flight short (its later steps
        would compute the request's tokens for nobody); True when a CutShort was sent."""
        if self._cuttable is None:
            return False
        self._cut(self._cuttable[0])
        return True

    def _cut(self, call_id: int) -> None:
        """Sends the call's one CutShort without waiting for it."""
        self._cuttable = None
        task = asyncio.ensure_future(self._send(call_id))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, call_id: int) -> None:
        try:
            await self.client.cut_short(call_id, CUT_SHORT_TIMEOUT_S)
        except Exception as err:  # ShardCallError, or a shard without CutShort: never fatal
            logger.info("CutShort of decode call %d failed (it runs to its end): %s", call_id, err)

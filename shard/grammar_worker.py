"""The shard's grammar thread: where constrained requests' matchers advance and their masks are
computed, off the engine's thread.

One thread, so a row's work stays in order (its token is consumed before its next mask is
computed) without locks; the masks of a whole batch are computed by llguidance's own parallel
executor, which releases the GIL, so the engine's thread runs the forward meanwhile.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import llguidance


class MaskWorker:
    """A single-thread pool for ordered grammar work and llguidance's parallel mask executor."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pytgi-grammar")
        self.executor = llguidance.LLExecutor()

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

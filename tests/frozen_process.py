"""A process held still for the length of a block: SIGSTOP on entry, SIGCONT on the way out.

Tests that need a request still unfinished at a given moment freeze the shard instead of
sleeping: a frozen shard completes no step, so whatever the router has not finished cannot
finish before the test acts, however fast the tiny model generates or however slow a loaded
machine makes the test. (A sleep raced the model: 180 tokens can take less than 0.3 s.) The
router keeps serving meanwhile, so its metrics say when a request has reached the point the
test waits for.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def frozen(pid: int) -> Iterator[None]:
    """Stops `pid` for the block and continues it after, even when the block fails (a shard
    left stopped would hang every later test of its module)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)

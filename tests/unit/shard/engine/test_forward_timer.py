"""ForwardTimer: wall clock on CPU, CUDA events on a GPU (read without a sync of its own)."""

from __future__ import annotations

import time

import pytest
import torch

from pytgi_shard.engine.forward_timer import ForwardTimer


def test_cpu_forwards_are_timed_by_the_wall_clock() -> None:
    """From construction to stop(), not to the read: bracketed by the test's own clock reads, so
    a loaded machine oversleeping changes the numbers but never the verdict (a fixed 20-40 ms
    window failed whenever a 20 ms sleep overslept by 20 ms)."""
    before_start = time.perf_counter_ns()
    timer = ForwardTimer(torch.device("cpu"))
    after_start = time.perf_counter_ns()
    time.sleep(0.02)
    before_stop = time.perf_counter_ns()
    timer.stop()
    after_stop = time.perf_counter_ns()
    time.sleep(0.02)  # a timer that ran until the read would now exceed the upper bound
    assert before_stop - after_start <= timer.elapsed_ns() <= after_stop - before_start


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_forwards_are_timed_on_the_device() -> None:
    device = torch.device("cuda")
    x = torch.randn(4096, 4096, device=device)
    timer = ForwardTimer(device)
    for _ in range(20):
        x = x @ x / 64.0
    timer.stop()
    # Queued, not waited for: the timer itself waits, once, when read.
    assert timer.elapsed_ns() > 0 and bool(torch.isfinite(x).all())

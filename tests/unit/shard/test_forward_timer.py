"""ForwardTimer: wall clock on CPU, CUDA events on a GPU (read without a sync of its own)."""

from __future__ import annotations

import time

import pytest
import torch

from pytgi_shard.forward_timer import ForwardTimer


def test_cpu_forwards_are_timed_by_the_wall_clock() -> None:
    timer = ForwardTimer(torch.device("cpu"))
    time.sleep(0.02)
    timer.stop()
    time.sleep(0.02)
    assert 20_000_000 <= timer.elapsed_ns() < 40_000_000


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

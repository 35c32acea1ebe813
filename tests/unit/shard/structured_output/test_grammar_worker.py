"""The grammar threads yield the cores to the forward: the grammar thread and llguidance's own
threads (spawned by it) run at a nice value `nice` above the process's, on Linux. On the CPU the
work runs inline instead, in order, on the engine's thread."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
import torch

from pytgi_shard.structured_output.worker import MaskWorker, lower_thread_priority

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice")


def _nice(tid: int) -> int:
    """A thread's nice value as the kernel reports it (field 19 of its stat line)."""
    stat = Path(f"/proc/self/task/{tid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[16])


def _threads() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


@linux_only
def test_the_grammar_thread_and_llguidances_threads_run_at_a_lower_priority() -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    before = _threads()
    worker = MaskWorker(nice=3)
    try:
        spawned = _threads() - before
        grammar = worker.pool.submit(threading.get_native_id).result()
        assert grammar in spawned
        # The grammar thread and at least one llguidance thread.
        assert len(spawned) >= 2
        assert {_nice(t) for t in spawned} == {min(base + 3, 19)}
        assert _nice(threading.get_native_id()) == base  # the caller's own is untouched
    finally:
        worker.shutdown()


@linux_only
def test_nice_zero_leaves_the_priority_and_the_value_stops_at_19() -> None:
    def run(nice: int) -> int:
        done: list[int] = []

        def body() -> None:
            lower_thread_priority(nice)
            done.append(_nice(threading.get_native_id()))

        thread = threading.Thread(target=body)
        thread.start()
        thread.join()
        return done[0]

    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert run(0) == base
    assert run(40) == 19


def test_an_inline_worker_runs_on_the_callers_thread_in_order_and_keeps_errors() -> None:
    worker = MaskWorker(inline=True)
    try:
        assert worker.pool is None and worker.executor is None
        seen: list[int] = []

        def note() -> int:
            seen.append(threading.get_native_id())
            return len(seen)

        first, second = worker.run(note), worker.run(note)
        assert (first.result(), second.result()) == (1, 2)
        assert seen == [threading.get_native_id()] * 2

        def refuse() -> None:
            raise ValueError("refused")

        failed = worker.run(refuse)
        assert failed.done()
        with pytest.raises(ValueError, match="refused"):
            failed.result()
    finally:
        worker.shutdown()


def test_the_device_chooses_inline_or_the_thread_unless_told() -> None:
    cases = [("cpu", None, True), ("cuda", None, False), ("cpu", True, False), ("cuda", False, True)]
    for device, thread, inline in cases:
        worker = MaskWorker.for_device(torch.device(device), thread)
        try:
            assert worker.inline is inline
        finally:
            worker.shutdown()

"""`--step-timeline PATH` (shard/service/timeline_file.py): the ring's rows as JSON lines, read
back by the summariser, appended across processes; a path that cannot be written refuses the
start in one line."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from pytgi_bench.compare.timeline_summary import read_timeline
from pytgi_shard.engine.step_timeline import MIXED, StepClock, StepTimeline, as_records
from pytgi_shard.service.startup import StartupRefused
from pytgi_shard.service.timeline_file import TimelineFile, format_rows


def _timeline(steps: int, first: int = 0) -> StepTimeline:
    timeline = StepTimeline(64)
    clock = StepClock()
    for i in range(first, first + steps):
        clock.begin(1_000 * i, MIXED)
        clock.launch, clock.forwarded = 1_000 * i + 10, 1_000 * i + 400
        clock.requests, clock.tokens, clock.device_ns = i + 1, 100 + i, 390
        timeline.record(clock, 1_000 * i + 500)
    return timeline


def test_lines_are_the_records_the_engine_made() -> None:
    rows = _timeline(3).drain()
    lines = format_rows(rows).splitlines()
    assert [json.loads(line) for line in lines] == as_records(rows)


def test_the_file_holds_every_step_once_across_two_processes(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "timeline.jsonl"
    for first in (0, 5):
        # A long interval: close() alone writes the rows (the last flush at shutdown).
        TimelineFile(_timeline(5, first), path, interval_s=60).start().close()
    text = path.read_text().splitlines()
    headers = [json.loads(line) for line in text if "step_timeline" in line]
    assert len(headers) == 2 and headers[0]["columns"][:3] == ["t_ns", "end_ns", "kind"]
    records = read_timeline(path)
    assert [r["t_ns"] for r in records] == [1_000 * i for i in range(10)]
    assert records[3]["kind"] == "mixed" and records[3]["forward_ns"] == 390


def test_an_unwritable_path_refuses_the_start(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(StartupRefused, match="--step-timeline"):
        TimelineFile(StepTimeline(), blocker / "timeline.jsonl").start()


def test_the_thread_writes_while_the_shard_runs(tmp_path: Path) -> None:
    path = tmp_path / "timeline.jsonl"
    timeline = StepTimeline(64)
    writer = TimelineFile(timeline, path, interval_s=0.01).start()
    try:
        clock = StepClock()
        clock.begin(5, MIXED)
        timeline.record(clock, 9)
        deadline = time.monotonic() + 5
        while not read_timeline(path) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [r["end_ns"] for r in read_timeline(path)] == [9]
    finally:
        writer.close()
    assert len(read_timeline(path)) == 1

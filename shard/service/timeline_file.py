"""`--step-timeline PATH`: rank 0's step timeline appended to a JSON-lines file.

The engine only puts tuples into its ring (shard/engine/step_timeline.py); formatting and
writing happen here, in a thread that wakes every `interval_s` and at shutdown, so no step pays
for them. Lines are formatted by a template (ints only), 16 at a time, and the thread yields the
GIL between chunks (sleep(0); a buffered write need not release it): the engine thread waits at
most one chunk's formatting behind this one (2-10 us a line, measured).

The file is opened for appending (a restarted shard adds to it); its first line from each
process says who wrote it and since when, then one object per step:
    {"t_ns": ..., "end_ns": ..., "kind": "decode", "requests": 64, "tokens": 64,
     "build_ns": ..., "forward_ns": ..., ..., "device_ns": ...}
t_ns/end_ns are perf_counter_ns (CLOCK_MONOTONIC on Linux), the clock a benchmark on the same
machine stamps its windows with to pick its steps (bench/compare/timeline_summary.py).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import TextIO

from pytgi_shard.engine.step_timeline import COLUMNS, KINDS, StepTimeline
from pytgi_shard.service.startup import StartupRefused

log = logging.getLogger(__name__)

# One step's line: every column an int but the kind, which goes by name.
_LINE = "{" + ", ".join(
    f'"{name}": "%s"' if name == "kind" else f'"{name}": %d' for name in COLUMNS
) + "}\n"
_KIND = COLUMNS.index("kind")
# Rows formatted between two yields of the GIL.
_CHUNK = 16


def format_rows(rows: list[tuple[int, ...]]) -> str:
    """The rows as JSON lines, the kind by name."""
    return "".join(
        _LINE % (*row[:_KIND], KINDS[row[_KIND]], *row[_KIND + 1 :]) for row in rows
    )


class TimelineFile:
    """Drains `timeline` into `path` from a daemon thread until close()."""

    def __init__(self, timeline: StepTimeline, path: Path, interval_s: float = 0.5) -> None:
        self._timeline = timeline
        self._path = path
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._file: TextIO | None = None
        self._thread = threading.Thread(target=self._run, name="step-timeline", daemon=True)
        self._reported_drops = 0

    def start(self) -> TimelineFile:
        """Opens the file (its header line first) and starts the thread; an unwritable path
        fails here, at start-up, not at the first flush."""
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self._path.open("a", encoding="utf-8")
        except OSError as e:
            raise StartupRefused(f"--step-timeline {self._path}: {e.strerror or e}") from e
        header = {"step_timeline": 1, "pid": os.getpid(), "columns": list(COLUMNS),
                  "since_ns": time.perf_counter_ns()}
        self._file.write(json.dumps(header) + "\n")
        self._file.flush()
        self._thread.start()
        log.info("step timeline: appending each step's phases to %s", self._path)
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.flush()

    def flush(self) -> None:
        """Writes what the ring holds, a chunk at a time."""
        file = self._file
        if file is None:
            return
        rows = self._timeline.drain()
        for i in range(0, len(rows), _CHUNK):
            file.write(format_rows(rows[i : i + _CHUNK]))
            time.sleep(0)
        file.flush()
        dropped = self._timeline.dropped
        if dropped > self._reported_drops:
            log.warning("step timeline: %d steps dropped (the writer fell a ring behind)", dropped)
            self._reported_drops = dropped

    def close(self) -> None:
        """Stops the thread and writes the last rows."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None

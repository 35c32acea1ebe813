"""The step timeline: where each engine step's time goes, one row of integers per step.

A short GPU run has to say by itself whether the time goes to the forward, to the host around
it, to waiting on the device or to the gaps between steps; a second run to find out costs a
whole GPU window. So every Prefill and Decode can stamp its phases with perf_counter_ns, and the
stamps of a step land as one tuple of ints in a preallocated ring: no dict, no log line, no
other allocation on the hot path. Off (the default) the engine still takes
the stamps (a dozen clock reads, under a microsecond) and records nothing.

A step's phases, in order (a phase the step has not is 0):
- build: from the RPC's arrival to the forward's launch (the batch from protobuf, grants,
  concatenation, the forward's inputs);
- forward: the host time of the forward call (on CUDA its launches, or a graph's replay; on the
  CPU the whole computation); 0 when the logits were computed ahead (overlap);
- choose: the token choice queued on the device (on the CPU: computed);
- ahead: the overlap scheduler launching the next decode forward;
- sync: the host waiting for the step's tokens (HostTransfer, the one synchronisation of a
  plain step; on the CPU the tokens are already there and it is ~0, measured, not assumed; the
  host reads of top tokens, watermarks and prefill logprobs fall in the phase that makes them);
- emit: detokenizing, stops, the Generations' bytes, the finished requests filtered out;
- reply: the live batch cached and the response completed.
`device_ns` is the device time of the forward(s) whose logits the step used (CUDA events; the
CPU's wall clock), so the device's idle share over a window is 1 - sum(device) / wall. The gap
between steps (the router, gRPC, Filter calls: the host's turn while the device waits unless a
forward was queued ahead) is the next row's start minus this row's end.

Rank 0's rows are written as JSON lines by shard/service/timeline_file.py
(`--step-timeline PATH`); the in-process benchmark (bench/compare/engine_steps.py) reads them
with `drain`; bench/compare/timeline_summary.py summarises them per step kind.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

KINDS = ("prefill", "mixed", "decode")
PREFILL, MIXED, DECODE = range(3)
# One row: the step's start and end (perf_counter_ns: CLOCK_MONOTONIC, comparable across the
# processes of one machine), what ran, and its phases in ns.
COLUMNS = ("t_ns", "end_ns", "kind", "requests", "tokens", "build_ns", "forward_ns", "choose_ns",
           "ahead_ns", "sync_ns", "emit_ns", "reply_ns", "device_ns")  # fmt: skip
PHASES = COLUMNS[5:12]
DEFAULT_CAPACITY = 16384


@dataclass(slots=True)
class StepClock:
    """One step's stamps (perf_counter_ns), set by the engine as the step goes. `begin` puts
    every stamp at the step's start; a path that skips a phase says so (`no_forward`,
    `no_sample`), which puts the skipped stamps at the previous one, so the phase is 0 and the
    next one does not start before it."""

    start: int = 0
    launch: int = 0
    forwarded: int = 0
    chosen: int = 0
    ahead: int = 0
    synced: int = 0
    emitted: int = 0
    kind: int = DECODE
    requests: int = 0
    tokens: int = 0
    device_ns: int = 0

    def begin(self, start: int, kind: int) -> None:
        """A new step that arrived at `start`: every later stamp starts there."""
        self.start = self.launch = self.forwarded = start
        self.chosen = self.ahead = self.synced = self.emitted = start
        self.kind, self.requests, self.tokens, self.device_ns = kind, 0, 0, 0

    def no_forward(self) -> None:
        """The step's logits were computed ahead: its forward phase is empty."""
        self.launch = self.forwarded = time.perf_counter_ns()

    def no_sample(self) -> None:
        """A step that chose no token (every chunk partial): the later phases are empty."""
        self.chosen = self.ahead = self.synced = self.emitted = self.forwarded


class StepTimeline:
    """A ring of `capacity` rows (tuples of ints), written by the engine's thread and drained by
    one reader (a writer thread or a benchmark). Rows the reader did not take before the ring
    came round are counted as dropped. A row is one tuple put in its slot at once, so a reader
    never sees half of one."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 2:
            raise ValueError(f"a step timeline needs a capacity of at least 2, got {capacity}")
        self._rows: list[tuple[int, ...]] = [()] * capacity
        self._capacity = capacity
        # Rows recorded since the start, and rows handed to the reader.
        self._written = 0
        self._read = 0
        self.dropped = 0

    def record(self, c: StepClock, end: int) -> None:
        """The step of `c`, ended at `end`: one tuple into the ring (~0.4 us; a numpy row
        assignment costs 2 us), then the count the reader goes by."""
        self._rows[self._written % self._capacity] = (
            c.start, end, c.kind, c.requests, c.tokens, c.launch - c.start,
            c.forwarded - c.launch, c.chosen - c.forwarded, c.ahead - c.chosen,
            c.synced - c.ahead, c.emitted - c.synced, end - c.emitted, c.device_ns,
        )  # fmt: skip
        self._written += 1

    def drain(self) -> list[tuple[int, ...]]:
        """The rows recorded since the last drain, oldest first. Safe from another thread: a
        slot the engine may have filled again while the slots were copied is dropped (counted
        in `dropped`), which only happens when the reader fell a whole ring behind."""
        written, start = self._written, self._read
        first = max(start, written - self._capacity + 1)
        rows = [self._rows[i % self._capacity] for i in range(first, written)]
        # Rows whose slot the engine reached again during the copy hold a newer step.
        safe_from = max(first, self._written - self._capacity + 1)
        self.dropped += safe_from - start
        self._read = written
        return rows[safe_from - first :]

    def __len__(self) -> int:
        """Rows recorded and not yet drained (at most the capacity)."""
        return min(self._written - self._read, self._capacity)


def as_records(rows: list[tuple[int, ...]]) -> list[dict[str, int | str]]:
    """Rows as the JSON objects of the timeline file (kind by name)."""
    out: list[dict[str, int | str]] = []
    for row in rows:
        record: dict[str, int | str] = dict(zip(COLUMNS, row, strict=True))
        record["kind"] = KINDS[row[2]]
        out.append(record)
    return out

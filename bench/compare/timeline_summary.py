"""Where a run's time went, per step kind, from the shard's step timeline.

    python -m pytgi_bench.compare.timeline_summary TIMELINE.jsonl [--from-ns A --to-ns B]
        [--json OUT]

The timeline is `--step-timeline PATH`'s file (shard/service/timeline_file.py) or the rows an
in-process engine recorded (bench/compare/engine_steps.py). Per kind (prefill, mixed, decode):
the steps, their median requests and tokens, p50/p90 of each phase (build, forward, choose,
ahead, sync, emit, reply, and the gap before the step: the router's turn), each phase's share of
the window's wall time, the device's idle share: 1 - its forwards' device time / the wall
time of the steps and the gaps before them, and the tokens its forwards took per second of
device time. What each phase holds: shard/engine/step_timeline.py.

Standard library only: bench/gpu.sh's summary loads this file by its path, where pytgi may not
have installed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TextIO

KINDS = ("prefill", "mixed", "decode")
PHASES = ("build", "forward", "choose", "ahead", "sync", "emit", "reply")
# The phases of the table: the step's own, the gap before it, the device's time in its forwards.
COLUMNS = (*PHASES, "gap", "device")
Record = dict[str, Any]


def read_timeline(path: Path) -> list[Record]:
    """The step records of a timeline file, in time order. Header lines (one per shard
    process) and a line cut off by a killed writer are skipped."""
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("kind") in KINDS:
            records.append(record)
    return sorted(records, key=lambda r: int(r["t_ns"]))


def within(records: Iterable[Record], start_ns: int, end_ns: int) -> list[Record]:
    """The steps that started inside [start_ns, end_ns] (perf_counter_ns of the same machine)."""
    return [r for r in records if start_ns <= int(r["t_ns"]) <= end_ns]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in (0, 1]); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]


def _with_gaps(records: list[Record]) -> list[tuple[Record, int]]:
    """Each step with the gap before it (its start minus the previous step's end; the first
    step's gap is unknown and taken as 0)."""
    out, previous_end = [], None
    for r in records:
        gap = 0 if previous_end is None else max(int(r["t_ns"]) - previous_end, 0)
        out.append((r, gap))
        previous_end = int(r["end_ns"])
    return out


def _kind_summary(steps: list[tuple[Record, int]], wall_ns: int) -> dict[str, Any]:
    """One kind's counts, phase percentiles (ms), shares of the wall time and idle share."""
    values: dict[str, list[float]] = {c: [] for c in COLUMNS}
    spans = []
    for r, gap in steps:
        for phase in PHASES:
            values[phase].append(int(r[f"{phase}_ns"]) / 1e6)
        values["gap"].append(gap / 1e6)
        values["device"].append(int(r["device_ns"]) / 1e6)
        spans.append(int(r["end_ns"]) - int(r["t_ns"]) + gap)
    busy_ms, span_ms = sum(values["device"]), sum(spans) / 1e6
    tokens = sum(int(r["tokens"]) for r, _ in steps)
    return {
        "steps": len(steps),
        # Tokens through the forward per second of the device's time in it (prefill: how near
        # the compute peak; decode: requests x steps per second of forward).
        "tokens": tokens,
        "device_tokens_per_s": tokens / busy_ms * 1e3 if busy_ms else 0.0,
        "requests_p50": percentile([float(r["requests"]) for r, _ in steps], 0.5),
        "tokens_p50": percentile([float(r["tokens"]) for r, _ in steps], 0.5),
        "step_ms": {"p50": percentile([s / 1e6 for s in spans], 0.5),
                    "p90": percentile([s / 1e6 for s in spans], 0.9)},
        "phases": {
            c: {"p50_ms": percentile(v, 0.5), "p90_ms": percentile(v, 0.9),
                "share": sum(v) * 1e6 / wall_ns if wall_ns else 0.0}
            for c, v in values.items()
        },
        "device_idle_share": max(1.0 - busy_ms / span_ms, 0.0) if span_ms else 0.0,
    }


def summarize(records: list[Record]) -> dict[str, Any]:
    """The window's totals and one summary per kind present (JSON-ready)."""
    if not records:
        return {"steps": 0, "wall_ms": 0.0, "device_idle_share": None, "kinds": {}}
    steps = _with_gaps(records)
    wall_ns = int(records[-1]["end_ns"]) - int(records[0]["t_ns"])
    busy_ns = sum(int(r["device_ns"]) for r in records)
    return {
        "steps": len(records),
        "wall_ms": wall_ns / 1e6,
        "device_busy_ms": busy_ns / 1e6,
        "device_idle_share": max(1.0 - busy_ns / wall_ns, 0.0) if wall_ns else 0.0,
        "kinds": {
            kind: _kind_summary(of_kind, wall_ns)
            for kind in KINDS
            if (of_kind := [(r, g) for r, g in steps if r["kind"] == kind])
        },
    }


def headline(summary: dict[str, Any]) -> str:
    """One line: the device's idle share and, per kind, its steps and largest phases (p50)."""
    if not summary.get("steps"):
        return "no steps recorded"
    parts = [f"{summary['steps']} steps, device idle {summary['device_idle_share']:.0%}"]
    for kind, k in summary["kinds"].items():
        top = sorted(((p["share"], c) for c, p in k["phases"].items() if c != "device"),
                     reverse=True)[:3]
        cells = ", ".join(f"{c} {k['phases'][c]['p50_ms']:.2f}" for _, c in top)
        parts.append(f"{kind} x{k['steps']} (b{k['requests_p50']:.0f}) "
                     f"step {k['step_ms']['p50']:.2f} ms: {cells}")
    return "; ".join(parts)


def print_summary(summary: dict[str, Any], title: str, stream: TextIO) -> None:
    """The per-kind table: p50/p90 ms of each phase, then each phase's share of the wall time."""
    if not summary.get("steps"):
        print(f"step timeline {title}: no steps recorded", file=stream)
        return
    print(f"step timeline {title}: {summary['steps']} steps in {summary['wall_ms'] / 1e3:.2f} s, "
          f"device busy {summary['device_busy_ms'] / 1e3:.2f} s, idle "
          f"{summary['device_idle_share']:.0%} (ms p50/p90; 'share': of the wall time)",
          file=stream)
    print(f"{'kind':<8} {'steps':>5} {'req':>5} {'tok':>6} " +
          " ".join(f"{c:>13}" for c in COLUMNS) + f" {'idle':>5} {'dev tok/s':>10}",
          file=stream)
    for kind, k in summary["kinds"].items():
        cells = " ".join(
            f"{k['phases'][c]['p50_ms']:.2f}/{k['phases'][c]['p90_ms']:.2f}".rjust(13)
            for c in COLUMNS
        )
        print(f"{kind:<8} {k['steps']:>5} {k['requests_p50']:>5.0f} {k['tokens_p50']:>6.0f} "
              f"{cells} {k['device_idle_share']:>5.0%} {k['device_tokens_per_s']:>10,.0f}",
              file=stream)
        shares = " ".join(f"{k['phases'][c]['share']:>13.1%}" for c in COLUMNS)
        print(f"{'  share':<26} {shares}", file=stream)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pytgi_bench.compare.timeline_summary",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("timeline", type=Path, help="a --step-timeline file")
    p.add_argument("--from-ns", type=int, default=None, help="first step start (perf_counter_ns)")
    p.add_argument("--to-ns", type=int, default=None, help="last step start (perf_counter_ns)")
    p.add_argument("--json", type=Path, default=None, help="write the summary here too")
    args = p.parse_args(argv)
    try:
        records = read_timeline(args.timeline)
    except OSError as e:
        print(f"timeline_summary: cannot read {args.timeline}: {e.strerror or e}", file=sys.stderr)
        return 2
    if args.from_ns is not None or args.to_ns is not None:
        records = within(records, args.from_ns or 0, args.to_ns or sys.maxsize)
    summary = summarize(records)
    print_summary(summary, str(args.timeline), sys.stdout)
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

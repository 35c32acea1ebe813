"""The side-by-side table of bench/compare/run.py, with ratios and the issue's targets checked."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import IO

from pytgi_bench.compare.system_result import SystemResult

# The single-stream rows: one request at a time, compared on latency rather than throughput.
SINGLE_STREAM = ("hf-compiled-b1", "pytgi-http-b1")


@dataclass(slots=True)
class TargetCheck:
    name: str
    ratio: float | None
    target: float
    # None when a side of the ratio was not measured.
    passed: bool | None
    against: str

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def _by_name(results: list[SystemResult]) -> dict[str, SystemResult]:
    return {r.system: r for r in results}


def ratio(results: list[SystemResult], system: str, baseline: str) -> float | None:
    named = _by_name(results)
    a, b = named.get(system), named.get(baseline)
    if a is None or b is None or not a.ok or not b.ok or b.tokens_per_s == 0:
        return None
    return a.tokens_per_s / b.tokens_per_s


def single_stream(result: SystemResult | None) -> dict[str, float] | None:
    """Median over rounds of a single-stream row's TTFT and TPOT (ms); None when not measured."""
    if result is None or not result.ok or not result.extra.get("single_stream"):
        return None
    rounds = result.extra["single_stream"]
    return {key: statistics.median(r[key] for r in rounds) for key in ("ttft_ms", "tpot_ms")}


def _latency_ratio(results: list[SystemResult], key: str) -> float | None:
    """transformers' latency over pytgi's: above 1 when pytgi is faster."""
    named = _by_name(results)
    ours = single_stream(named.get("pytgi-http-b1"))
    theirs = single_stream(named.get("hf-compiled-b1"))
    if ours is None or theirs is None or ours[key] <= 0:
        return None
    return theirs[key] / ours[key]


def _check(name: str, value: float | None, target: float, against: str) -> TargetCheck:
    return TargetCheck(name, value, target, None if value is None else value >= target, against)


def check_targets(results: list[SystemResult]) -> list[TargetCheck]:
    """The issue's targets for pytgi end to end, each checked when its baseline row was run:
    the CPU ones (throughput against transformers' ways of batching and the in-process engine)
    and, for the single-stream rows, latency parity with transformers' compiled generate."""
    named = _by_name(results)
    cb = "hf-cb" if named.get("hf-cb") and named["hf-cb"].ok else "hf-cb-cpu-patched"
    if cb not in named and "hf-cb" in named:
        cb = "hf-cb"
    throughput = [
        ("end-to-end >= 8x transformers request by request", "hf-sequential", 8.0),
        ("end-to-end >= 0.8x one static batch", "hf-static", 0.8),
        ("end-to-end >= transformers continuous batching", cb, 1.0),
        ("end-to-end within 15% of the in-process engine", "pytgi-inprocess", 0.85),
    ]
    out = [
        _check(name, ratio(results, "pytgi-http", baseline), target, baseline)
        for name, baseline, target in throughput
        if baseline in named
    ]
    if "pytgi-http-b1" in named and "hf-compiled-b1" in named:
        out.append(_check("single stream: time per output token <= transformers compiled "
                          "(their ms / ours)", _latency_ratio(results, "tpot_ms"), 1.0,
                          "hf-compiled-b1"))
        out.append(_check("single stream: time to first token <= transformers "
                          "(their ms / ours)", _latency_ratio(results, "ttft_ms"), 1.0,
                          "hf-compiled-b1"))
    return out


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or math.isnan(value) else format(value, spec)


def _notes(r: SystemResult, expected_tokens: int) -> str:
    if not r.ok:
        return f"{r.status.upper()}: {r.error}"
    notes = r.description
    want = int(r.extra.get("expected_tokens", expected_tokens))
    if any(t != want for t in r.output_tokens):
        notes += f" [TOKENS {r.output_tokens} != {want}]"
    return notes


def print_table(results: list[SystemResult], expected_tokens: int, out: IO[str]) -> None:
    baselines = ("hf-sequential", "hf-static", "hf-cb", "hf-cb-cpu-patched")
    header = (
        f"{'system':<20} {'wall s':>8} {'tok/s':>9} {'min-max tok/s':>15} {'x seq':>7} {'x static':>9} "
        f"{'x hf-cb':>8} {'x hf-cb*':>9} {'start s':>8}  notes"
    )
    print(header, file=out)
    print("-" * len(header), file=out)
    for r in results:
        # A single-stream row's tok/s is one request's speed: no ratio to a batched baseline.
        cells = [
            "-" if r.system in SINGLE_STREAM else _fmt(ratio(results, r.system, b), ".2f")
            for b in baselines
        ]
        wall = _fmt(r.median_wall_s if r.ok else None, ".2f")
        speed = _fmt(r.tokens_per_s if r.ok else None, ".1f")
        rates = [t / w for t, w in zip(r.output_tokens, r.wall_s, strict=True) if w > 0]
        spread = f"{min(rates):.0f}-{max(rates):.0f}" if r.ok and rates else "-"
        print(
            f"{r.system:<20} {wall:>8} {speed:>9} {spread:>15} {cells[0]:>7} {cells[1]:>9} {cells[2]:>8} "
            f"{cells[3]:>9} {_fmt(r.startup_s, '.1f'):>8}  {_notes(r, expected_tokens)}",
            file=out,
        )
    print(
        "(tok/s: median over rounds; x hf-cb*: against transformers generate_batch with its CPU "
        "memory probe patched)",
        file=out,
    )
    singles = [r for r in results if r.system in SINGLE_STREAM]
    if singles:
        print(file=out)
        print(f"{'single stream':<20} {'TTFT p50 ms':>12} {'TPOT p50 ms':>12}", file=out)
        for r in singles:
            latency = single_stream(r) or {}
            print(f"{r.system:<20} {_fmt(latency.get('ttft_ms'), '.1f'):>12} "
                  f"{_fmt(latency.get('tpot_ms'), '.2f'):>12}", file=out)
    print(file=out)
    for check in check_targets(results):
        verdict = {True: "PASS", False: "MISS", None: "N/A"}[check.passed]
        print(
            f"{verdict:<5} {check.name}: {_fmt(check.ratio, '.2f')} "
            f"(target {check.target:g}, vs {check.against})",
            file=out,
        )

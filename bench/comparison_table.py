"""The side-by-side table of bench/compare.py, with ratios and the issue's targets checked."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import IO

from pytgi_bench.system_result import SystemResult


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


def check_targets(results: list[SystemResult]) -> list[TargetCheck]:
    """The issue's CPU targets for pytgi end to end (pytgi-http)."""
    named = _by_name(results)
    cb = "hf-cb" if named.get("hf-cb") and named["hf-cb"].ok else "hf-cb-cpu-patched"
    checks = [
        ("end-to-end >= 8x transformers request by request", "hf-sequential", 8.0),
        ("end-to-end >= 0.8x one static batch", "hf-static", 0.8),
        ("end-to-end >= transformers continuous batching", cb, 1.0),
        ("end-to-end within 15% of the in-process engine", "pytgi-inprocess", 0.85),
    ]
    out = []
    for name, baseline, target in checks:
        value = ratio(results, "pytgi-http", baseline)
        out.append(
            TargetCheck(name, value, target, None if value is None else value >= target, baseline)
        )
    return out


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or math.isnan(value) else format(value, spec)


def print_table(results: list[SystemResult], expected_tokens: int, out: IO[str]) -> None:
    baselines = ("hf-sequential", "hf-static", "hf-cb", "hf-cb-cpu-patched")
    header = (
        f"{'system':<20} {'wall s':>8} {'tok/s':>9} {'min-max tok/s':>15} {'x seq':>7} {'x static':>9} "
        f"{'x hf-cb':>8} {'x hf-cb*':>9} {'start s':>8}  notes"
    )
    print(header, file=out)
    print("-" * len(header), file=out)
    for r in results:
        cells = [_fmt(ratio(results, r.system, b), ".2f") for b in baselines]
        if r.ok:
            notes = r.description
            want = int(r.extra.get("expected_tokens", expected_tokens))
            if any(t != want for t in r.output_tokens):
                notes += f" [TOKENS {r.output_tokens} != {want}]"
        else:
            notes = f"{r.status.upper()}: {r.error}"
        wall = _fmt(r.median_wall_s if r.ok else None, ".2f")
        speed = _fmt(r.tokens_per_s if r.ok else None, ".1f")
        rates = [t / w for t, w in zip(r.output_tokens, r.wall_s, strict=True) if w > 0]
        spread = f"{min(rates):.0f}-{max(rates):.0f}" if r.ok and rates else "-"
        print(
            f"{r.system:<20} {wall:>8} {speed:>9} {spread:>15} {cells[0]:>7} {cells[1]:>9} {cells[2]:>8} "
            f"{cells[3]:>9} {_fmt(r.startup_s, '.1f'):>8}  {notes}",
            file=out,
        )
    print(
        "(tok/s: median over rounds; x hf-cb*: against transformers generate_batch with its CPU "
        "memory probe patched)",
        file=out,
    )
    print(file=out)
    for check in check_targets(results):
        verdict = {True: "PASS", False: "MISS", None: "N/A"}[check.passed]
        print(
            f"{verdict:<5} {check.name}: {_fmt(check.ratio, '.2f')} "
            f"(target {check.target:g}, vs {check.against})",
            file=out,
        )

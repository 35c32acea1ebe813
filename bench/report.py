"""Printing a run's results as a table and saving them as JSON (with per-request timings)."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

from pytgi_bench.benchmark import BenchmarkReport, BenchmarkRun
from pytgi_bench.summary import LatencyStats, Summary

_WIDTH = 64


def _line(label: str, value: object, out: IO[str]) -> None:
    print(f"{label:<44}{value!s:>20}", file=out)


def _latency(name: str, stats: LatencyStats, out: IO[str]) -> None:
    print(f"{'-' * 6} {name} {'-' * (_WIDTH - 8 - len(name))}", file=out)
    for label, value in (
        ("Mean", stats.mean_ms),
        ("Median", stats.p50_ms),
        ("P90", stats.p90_ms),
        ("P99", stats.p99_ms),
    ):
        _line(f"{label} {name.split()[0]} (ms):", f"{value:.2f}", out)


def print_run(run: BenchmarkRun, out: IO[str]) -> None:
    s: Summary = run.summary
    rate = "inf" if math.isinf(run.request_rate) else f"{run.request_rate:g}"
    title = f" Serving Benchmark Result (concurrency {run.concurrency or 'max'}, rate {rate}) "
    print(f"{title:=^{_WIDTH}}", file=out)
    _line("Successful requests:", s.completed, out)
    _line("Failed requests:", s.failed, out)
    _line("Benchmark duration (s):", f"{s.duration_s:.2f}", out)
    _line("Total input tokens:", s.total_input_tokens, out)
    _line("Total generated tokens:", s.total_output_tokens, out)
    _line("Requested output tokens:", s.requested_output_tokens, out)
    _line("Request throughput (req/s):", f"{s.request_throughput:.2f}", out)
    _line("Output token throughput (tok/s):", f"{s.output_throughput:.2f}", out)
    _line("Peak output token throughput (tok/s):", f"{s.peak_output_throughput:.2f}", out)
    _line("Total token throughput (tok/s):", f"{s.total_token_throughput:.2f}", out)
    _line("Max concurrency:", s.max_concurrency, out)
    if s.goodput is not None:
        slo = " ".join(f"{k}:{v:g}" for k, v in s.slo_ms.items())
        _line(f"Goodput (req/s) [{slo}]:", f"{s.goodput:.2f}", out)
    _latency("Time to First Token", s.ttft, out)
    _latency("Time per Output Token (excl. 1st token)", s.tpot, out)
    _latency("Inter-token Latency", s.itl, out)
    _latency("E2E Latency", s.e2el, out)
    if s.finish_reasons:
        _line("Finish reasons:", ", ".join(f"{k}={v}" for k, v in s.finish_reasons.items()), out)
    for message, count in s.errors.items():
        print(f"error x{count}: {message}", file=out)
    print("=" * _WIDTH, file=out)


def _run_json(run: BenchmarkRun, per_request: bool) -> dict[str, Any]:
    requests = [
        {
            "ok": r.ok,
            "start_s": round(r.start - run.load.started, 6),
            "ttft_ms": round(r.ttft * 1000, 3),
            "e2el_ms": round(r.latency * 1000, 3),
            "input_tokens": r.input_tokens,
            "output_tokens": r.output_tokens,
            "max_new_tokens": r.max_new_tokens,
            "finish_reason": r.finish_reason,
            "error": r.error,
            "itl_ms": [round(gap * 1000, 3) for gap in r.itl],
        }
        for r in run.load.results
    ]
    if not per_request:
        return {
            "concurrency": run.concurrency,
            "request_rate": None if math.isinf(run.request_rate) else run.request_rate,
            "summary": run.summary.to_json(),
        }
    return {
        "concurrency": run.concurrency,
        "request_rate": None if math.isinf(run.request_rate) else run.request_rate,
        "summary": run.summary.to_json(),
        "requests": requests,
    }


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }


def report_json(report: BenchmarkReport, per_request: bool = True) -> dict[str, Any]:
    settings = asdict(report.settings)
    settings.pop("api_key", None)
    settings["input_len"] = str(report.settings.input_len)
    settings["output_len"] = str(report.settings.output_len)
    if math.isinf(report.settings.request_rate):
        settings["request_rate"] = None
    return {
        "tool": "pytgi-benchmark run",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "settings": settings,
        "server_info": report.server_info,
        "workload": {
            "requests": len(report.workload.items),
            "input_lengths_exact": report.workload.input_lengths_exact,
            "length_mismatches": report.workload.length_mismatches,
        },
        "runs": [_run_json(run, per_request) for run in report.runs],
    }


def save_json(data: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")

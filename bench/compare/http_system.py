"""The pytgi rows of bench/compare/run.py: `pytgi-launcher` end to end, driven over HTTP by the load
tool.

The server starts on the first run (its start-up time is reported on that row) and serves every
workload until `stop()`; on a GPU compare.py stops it before each transformers row, whose
process would otherwise find the GPU's memory taken by pytgi's KV cache, and the next pytgi row
starts it again. Each workload first sends a few warm-up requests of its own prompts, which are
not among the timed ones (a timed prompt the server has seen would hit its prefix cache), then
sends the timed prompts as concurrent streaming `/generate_stream` clients — all at once, or one
at a time for the single-stream row — timed from the first request sent to the last token.

The server writes its step timeline (`--step-timeline`, shard/engine/step_timeline.py) to the
work directory; each row remembers the window it was timed in, and once the server has stopped
(its last rows written) `attach_timelines` puts the summary of that window's steps in the row
(`extra["timeline"]`, bench/compare/timeline_summary.py): where the row's time went.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pytgi_bench.benchmark import run_benchmark
from pytgi_bench.compare.server_process import PytgiServer, ServerStartError
from pytgi_bench.compare.system_result import SystemResult
from pytgi_bench.compare.timeline_summary import read_timeline, summarize, within
from pytgi_bench.settings import LoadSettings
from pytgi_bench.summary import Summary
from pytgi_router.server import run_event_loop


@dataclass(frozen=True, slots=True)
class HttpWorkload:
    system: str
    description: str
    prompts: list[str]
    new_tokens: int
    # In flight at once; None sends every prompt at once.
    concurrency: int | None
    # Sent (untimed, all at once) before the timed prompts; never among them.
    warmup_prompts: list[str]


def _latencies(summary: Summary) -> dict[str, dict[str, float]]:
    return {
        f"{name}_ms": {"p50": stats.p50_ms, "p99": stats.p99_ms}
        for name, stats in (
            ("ttft", summary.ttft),
            ("tpot", summary.tpot),
            ("itl", summary.itl),
            ("e2el", summary.e2el),
        )
    }


def _prompts_file(path: Path, prompts: list[str], new_tokens: int) -> Path:
    path.write_text(
        "".join(json.dumps({"prompt": p, "max_new_tokens": new_tokens}) + "\n" for p in prompts)
    )
    return path


class HttpSystem:
    def __init__(
        self,
        model_dir: Path,
        work_dir: Path,
        threads: int | None,
        extra_args: list[str],
        timeline: bool = True,
    ) -> None:
        self._work_dir = work_dir
        # Appended by every server start of this run; a previous run's steps are not this one's.
        self.timeline_path = work_dir / "pytgi-timeline.jsonl"
        self.timeline_path.unlink(missing_ok=True)
        flags = ["--step-timeline", str(self.timeline_path)] if timeline else []
        self._timeline = timeline
        self._server = PytgiServer(
            model_dir, work_dir / "pytgi-server.log", threads=threads,
            extra_args=[*extra_args, *flags],
        )
        self._started = False

    def _load(
        self, workload: HttpWorkload, name: str, prompts: list[str], concurrency: int | None
    ) -> Summary:
        settings = LoadSettings(
            url=self._server.url,
            prompts_file=_prompts_file(
                self._work_dir / f"{workload.system}.{name}.jsonl", prompts, workload.new_tokens
            ),
            num_requests=len(prompts),
            concurrency=concurrency,
            warmup=0,
            progress=False,
        )
        (run,) = run_event_loop(run_benchmark(settings)).runs
        return run.summary

    def run(self, workload: HttpWorkload) -> SystemResult:
        """One timed pass of `workload` (starting the server when it is not running)."""
        result = SystemResult(workload.system, workload.description)
        if not self._started:
            try:
                self._server.start()
            except ServerStartError as exc:
                result.status, result.error = "error", str(exc)
                return result
            self._started = True
            result.startup_s = self._server.startup_s
        if workload.warmup_prompts:
            warm = self._load(workload, "warmup", workload.warmup_prompts, None)
            if warm.failed:
                result.status, result.error = "error", f"warm-up failed: {warm.errors}"
                return result
        # The same clock as the timeline's steps (perf_counter_ns: CLOCK_MONOTONIC).
        window = [time.perf_counter_ns()]
        summary = self._load(workload, "timed", workload.prompts, workload.concurrency)
        window.append(time.perf_counter_ns())
        if summary.failed:
            result.status = "error"
            result.error = f"{summary.failed} requests failed: {summary.errors}"
        result.wall_s.append(summary.duration_s)
        result.output_tokens.append(summary.total_output_tokens)
        result.extra = {"latency": _latencies(summary), "server_log": str(self._server.log_path),
                        "timeline_windows_ns": [window]}
        if workload.concurrency == 1:
            result.extra["single_stream"] = [
                {"ttft_ms": summary.ttft.p50_ms, "tpot_ms": summary.tpot.p50_ms}
            ]
        return result

    def stop(self) -> None:
        """Stops the server (the next run starts it again)."""
        self._server.stop()
        self._started = False

    def attach_timelines(self, results: Iterable[SystemResult | None]) -> None:
        """Each HTTP row's `extra["timeline"]`: the summary of the steps inside its timed
        windows (every round's). Call once the server has stopped, when its last rows are
        written; a row whose steps are missing says so rather than failing the run."""
        rows = [r for r in results if r is not None and r.extra.get("timeline_windows_ns")]
        if not rows or not self._timeline:
            return
        try:
            records = read_timeline(self.timeline_path)
        except OSError as e:
            for r in rows:
                r.extra["timeline"] = {"error": f"no step timeline: {e}"}
            return
        for r in rows:
            steps = [s for a, b in r.extra["timeline_windows_ns"] for s in within(records, a, b)]
            r.extra["timeline"] = summarize(steps)

    def close(self) -> None:
        self.stop()

"""Row (b) of bench/compare.py: pytgi end to end, `pytgi-launcher` driven over HTTP by the load tool.

The server starts once (its start-up time is reported apart) and serves every round (on a GPU it
restarts per round: see keep_running); each round sends all prompts at once as concurrent
streaming `/generate_stream` clients and is timed from the first request sent to the last token
received.
"""

from __future__ import annotations

import json
from pathlib import Path

from pytgi_bench.benchmark import run_benchmark
from pytgi_bench.server_process import PytgiServer, ServerStartError
from pytgi_bench.settings import LoadSettings
from pytgi_bench.summary import Summary
from pytgi_bench.system_result import SystemResult
from pytgi_router import event_loop

# A few requests before each timed round: connections, allocator, first-call paths.
_WARMUP_REQUESTS = 4


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


class HttpSystem:
    def __init__(
        self,
        model_dir: Path,
        prompts: list[tuple[str, list[int]]],
        new_tokens: int,
        work_dir: Path,
        threads: int | None,
        keep_running: bool = True,
    ) -> None:
        self._prompts_file = work_dir / "prompts.jsonl"
        self._prompts_file.write_text(
            "".join(
                json.dumps({"prompt": text, "max_new_tokens": new_tokens}) + "\n"
                for text, _ in prompts
            )
        )
        self._count = len(prompts)
        self._server = PytgiServer(
            model_dir,
            work_dir / "pytgi-server.log",
            threads=threads,
            extra_args=["--max-concurrent-requests", str(max(128, self._count))],
        )
        self._started = False
        # On a GPU the server's weights and KV cache would starve the next system's process:
        # there it stops after every round (and starts again, untimed, for the next).
        self._keep_running = keep_running

    def run_once(self) -> SystemResult:
        """One timed round (the server starts on the first call); the round's result alone."""
        round_result = SystemResult(
            "pytgi-http",
            f"pytgi-launcher end to end, {self._count} concurrent streaming HTTP clients",
        )
        if not self._started:
            try:
                self._server.start()
            except ServerStartError as exc:
                round_result.status, round_result.error = "error", str(exc)
                return round_result
            self._started = True
            round_result.startup_s = self._server.startup_s
        settings = LoadSettings(
            url=self._server.url,
            prompts_file=self._prompts_file,
            num_requests=self._count,
            warmup=_WARMUP_REQUESTS,
            progress=False,
        )
        try:
            (run,) = event_loop.run(run_benchmark(settings)).runs
        finally:
            if not self._keep_running:
                self._server.stop()
                self._started = False
        summary = run.summary
        if summary.failed:
            round_result.status = "error"
            round_result.error = f"{summary.failed} requests failed: {summary.errors}"
        round_result.wall_s.append(summary.duration_s)
        round_result.output_tokens.append(summary.total_output_tokens)
        round_result.extra = {
            "latency": _latencies(summary),
            "server_log": str(self._server.log_path),
        }
        return round_result

    def close(self) -> None:
        self._server.stop()

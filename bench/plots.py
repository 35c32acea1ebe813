"""PNG plots of a run: latency CDFs per concurrency level, and a throughput-vs-concurrency sweep."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pytgi_bench.benchmark import BenchmarkRun
from pytgi_bench.shard_benchmark import BatchSizeResult


def _pyplot():  # type: ignore[no-untyped-def]
    # Agg: plots are files, never windows (benchmarks run headless over ssh and in CI).
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(run: BenchmarkRun) -> str:
    return f"concurrency {run.concurrency}" if run.concurrency else "unbounded"


def _samples(run: BenchmarkRun) -> dict[str, list[float]]:
    done = [r for r in run.load.results if r.ok]
    return {
        "TTFT": [r.ttft * 1000 for r in done],
        "TPOT": [t * 1000 for r in done if (t := r.tpot) is not None],
        "ITL": [gap * 1000 for r in done for gap in r.itl],
        "E2E latency": [r.latency * 1000 for r in done],
    }


def plot_latency_cdfs(runs: list[BenchmarkRun], path: Path, title: str) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for run in runs:
        for ax, (_metric, values) in zip(axes.flat, _samples(run).items(), strict=True):
            if not values:
                continue
            xs = np.sort(np.asarray(values))
            ys = np.arange(1, len(xs) + 1) / len(xs)
            ax.step(xs, ys, where="post", label=_label(run))
    for ax, metric in zip(axes.flat, ("TTFT", "TPOT", "ITL", "E2E latency"), strict=True):
        ax.set_title(f"{metric} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sweep(runs: list[BenchmarkRun], path: Path, title: str) -> Path:
    plt = _pyplot()
    levels = [run.concurrency or 0 for run in runs]
    summaries = [run.summary for run in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    left.plot(levels, [s.output_throughput for s in summaries], marker="o", label="output tok/s")
    left.set_xlabel("concurrency")
    left.set_ylabel("output tokens/s")
    left.set_title("Throughput vs concurrency")
    twin = left.twinx()
    twin.plot(
        levels,
        [s.request_throughput for s in summaries],
        marker="s",
        linestyle="--",
        color="tab:orange",
        label="requests/s",
    )
    twin.set_ylabel("requests/s")
    for metric, stats in (
        ("TTFT", [s.ttft for s in summaries]),
        ("TPOT", [s.tpot for s in summaries]),
    ):
        right.plot(levels, [st.p50_ms for st in stats], marker="o", label=f"{metric} p50")
        right.plot(
            levels, [st.p99_ms for st in stats], marker="x", linestyle="--", label=f"{metric} p99"
        )
    right.set_xlabel("concurrency")
    right.set_ylabel("ms")
    right.set_title("Latency vs concurrency")
    right.legend(fontsize="small")
    for ax in (left, right):
        if len(set(levels)) > 1 and min(levels) > 0:
            ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_shard_latency(results: list[BatchSizeResult], sequence_length: int, path: Path) -> Path:
    """Latency vs throughput per batch size, for prefill and decode (TGI benchmark's plots)."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, title, points in (
        (
            left,
            "Prefill",
            [
                (r.batch_size, r.batch_size * sequence_length / t * 1.0, t * 1000.0)
                for r in results
                for t in r.prefill_latency
            ],
        ),
        (
            right,
            "Decode (per token)",
            [
                (r.batch_size, r.batch_size * s / t, t / s * 1000.0)
                for r in results
                for t, s in zip(r.decode_latency, r.decode_steps, strict=True)
                if s
            ],
        ),
    ):
        for size in sorted({p[0] for p in points}):
            xs = [p[1] for p in points if p[0] == size]
            ys = [p[2] for p in points if p[0] == size]
            ax.scatter(xs, ys, s=14, label=f"batch {size}")
        ax.set_title(f"{title}: latency vs throughput")
        ax.set_xlabel("tokens/s")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

"""The `shards` subcommand: flags named like TGI's text-generation-benchmark, tables, JSON."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import sys
from pathlib import Path
from typing import IO, Any

from pytgi_bench.shard_benchmark import BatchSizeResult, ShardBenchmark, ShardBenchSettings
from pytgi_bench.summary import LatencyStats

# The shard's default socket base name (TGI's), rank r listening on `{base}-{r}`.
DEFAULT_UDS_BASE = "/tmp/text-generation-server"
EXIT_OK, EXIT_SETUP = 0, 2


def add_shards_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "shards",
        help="prefill/decode latency of the shards over gRPC (no router)",
        description="Like TGI's text-generation-benchmark. It warms up and clears the shard "
        "cache, so run it against an idle server.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--uds-path",
        default=DEFAULT_UDS_BASE,
        help="socket base name of the shards; rank 0 is at UDS_PATH-0",
    )
    where.add_argument(
        "--master-shard-uds-path", default=None, help="rank 0's socket path itself (TGI's flag)"
    )
    where.add_argument(
        "--master", default=None, help="rank 0's gRPC address, e.g. unix:///tmp/s-0 or host:50051"
    )
    p.add_argument(
        "--batch-size",
        "-b",
        type=int,
        action="append",
        default=None,
        help="repeatable; default 1 2 4 8 16 32",
    )
    p.add_argument("--sequence-length", "-s", type=int, default=10)
    p.add_argument("--decode-length", "-d", type=int, default=8)
    p.add_argument("--runs", "-r", type=int, default=10)
    p.add_argument("--warmups", "-w", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--connect-timeout", type=float, default=30.0, help="seconds")
    p.add_argument("--out", type=Path, default=None, help="write results JSON here")
    p.add_argument("--no-plots", action="store_true", help="with --out: skip the PNG plot")


def _master(args: argparse.Namespace) -> str:
    if args.master:
        return str(args.master)
    path = args.master_shard_uds_path or f"{args.uds_path}-0"
    if not Path(path).exists():
        # gRPC would wait out the whole connect timeout on a socket that is not there.
        raise ValueError(f"no shard socket at {path}: is `pytgi-shard serve` running there?")
    return f"unix://{path}"


def _stats_row(step: str, size: int, stats: LatencyStats, out: IO[str]) -> None:
    cells = (stats.mean_ms, stats.min_ms, stats.max_ms, stats.p50_ms, stats.p90_ms, stats.p99_ms)
    print(
        f"| {step:<22} | {size:>10} | " + " | ".join(f"{v:>9.2f}" for v in cells) + " |", file=out
    )


def print_results(results: list[BatchSizeResult], seq_len: int, out: IO[str]) -> None:
    header = ["Step", "Batch Size", "Average", "Lowest", "Highest", "p50", "p90", "p99"]
    print(
        f"| {header[0]:<22} | {header[1]:>10} | "
        + " | ".join(f"{h:>9}" for h in header[2:])
        + " |  (ms)",
        file=out,
    )
    for r in results:
        _stats_row("Prefill", r.batch_size, LatencyStats.of(r.prefill_latency), out)
    for r in results:
        per_token = [t / s for t, s in zip(r.decode_latency, r.decode_steps, strict=True) if s]
        _stats_row("Decode (token)", r.batch_size, LatencyStats.of(per_token), out)
    for r in results:
        _stats_row("Decode (total)", r.batch_size, LatencyStats.of(r.decode_latency), out)
    print(file=out)
    print(
        f"| {'Step':<22} | {'Batch Size':>10} | {'Average':>11} | {'Lowest':>11} | "
        f"{'Highest':>11} | {'shard ms':>9} | {'forward':>9} |  (tokens/s; per call ms)",
        file=out,
    )
    for r in results:
        s = r.summary(seq_len)
        for step, key, shard_key, forward_key in (
            ("Prefill", "prefill_throughput", "prefill_shard_ms", None),
            ("Decode", "decode_throughput", "decode_step_shard_ms", "decode_step_forward_ms"),
        ):
            v: dict[str, float] = s[key]  # type: ignore[assignment]
            forward = f"{s[forward_key]:>9.2f}" if forward_key else f"{'':>9}"
            print(
                f"| {step:<22} | {r.batch_size:>10} | {v['avg']:>11.2f} | {v['min']:>11.2f} | "
                f"{v['max']:>11.2f} | {s[shard_key]:>9.2f} | {forward} |",
                file=out,
            )


async def _run(
    settings: ShardBenchSettings, progress: bool
) -> tuple[dict[str, Any], list[BatchSizeResult]]:
    from pytgi_router.core.shard_client import ShardClient

    client = await ShardClient.connect(settings.master, timeout=settings.connect_timeout_s)
    try:
        bench = ShardBenchmark(client, settings)
        await bench.prepare()
        results = []
        for size in settings.batch_sizes:
            if progress:
                print(
                    f"batch size {size}: {settings.warmups} warm-up + {settings.runs} runs",
                    file=sys.stderr,
                )
            results.append(await bench.run_batch_size(size))
        info = bench.info
        meta = {
            "world_size": client.world_size,
            "model_type": info.model_type if info else None,
            "dtype": info.dtype if info else None,
            "device_type": info.device_type if info else None,
            "attention_impl": info.attention_impl if info else None,
            "block_size": bench.block_size,
            "num_blocks": bench.num_blocks,
        }
        return meta, results
    finally:
        await client.close()


def shards_command(args: argparse.Namespace) -> int:
    from pytgi_bench.report import machine, save_json
    from pytgi_router.core.shard_client import ShardCallError

    try:
        settings = ShardBenchSettings(
            master=_master(args),
            batch_sizes=tuple(args.batch_size or (1, 2, 4, 8, 16, 32)),
            sequence_length=args.sequence_length,
            decode_length=args.decode_length,
            runs=args.runs,
            warmups=args.warmups,
            seed=args.seed,
            connect_timeout_s=args.connect_timeout,
        )
        meta, results = asyncio.run(_run(settings, progress=True))
    except (ShardCallError, ValueError) as exc:
        print(f"pytgi-benchmark shards: error: {exc}", file=sys.stderr)
        return EXIT_SETUP
    print_results(results, settings.sequence_length, sys.stdout)
    if args.out is not None:
        data = {
            "tool": "pytgi-benchmark shards",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(),
            "settings": {
                "master": settings.master,
                "batch_sizes": list(settings.batch_sizes),
                "sequence_length": settings.sequence_length,
                "decode_length": settings.decode_length,
                "runs": settings.runs,
                "warmups": settings.warmups,
            },
            "shards": meta,
            "results": [r.summary(settings.sequence_length) for r in results],
        }
        save_json(data, args.out)
        print(f"results: {args.out}", file=sys.stderr)
        if not args.no_plots:
            from pytgi_bench.plots import plot_shard_latency

            path = plot_shard_latency(
                results, settings.sequence_length, args.out.with_suffix(".png")
            )
            print(f"plot: {path}", file=sys.stderr)
    return EXIT_OK

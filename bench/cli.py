"""`pytgi-benchmark`: `run` loads an HTTP endpoint, `shards` drives the gRPC shards directly.

Exit codes: 0 success, 1 the run produced no successful request (or failures under --strict),
2 bad arguments or an endpoint that cannot be reached.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from pytgi_bench.settings import APIS, HTTP_CLIENTS, LengthRange, LoadSettings, parse_slo
from pytgi_router.server import run_event_loop

EXIT_OK, EXIT_FAILED, EXIT_SETUP = 0, 1, 2


def _concurrency_list(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be positive integers")
    return levels


def _length(text: str) -> LengthRange:
    try:
        return LengthRange.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_run_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "run",
        help="load an HTTP endpoint (pytgi, TGI or OpenAI-compatible)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8080")
    p.add_argument("--api", choices=APIS, default="tgi")
    p.add_argument("--model", default="tgi", help="`model` field of OpenAI requests")
    p.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    p.add_argument(
        "--input-len",
        type=_length,
        default=LengthRange(32, 33),
        help="prompt tokens: N or LOW:HIGH (uniform in [LOW, HIGH))",
    )
    p.add_argument(
        "--output-len",
        type=_length,
        default=LengthRange(64, 65),
        help="max_new_tokens: N or LOW:HIGH",
    )
    p.add_argument(
        "--prompts-file",
        type=Path,
        default=None,
        help=".jsonl ({'prompt', 'max_new_tokens'?} per line), .json list, or .txt",
    )
    p.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="local tokenizer.json or model dir for exact lengths (default: /tokenize)",
    )
    p.add_argument("--num-requests", "-n", type=int, default=64)
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help="run for this many seconds instead (cycling the workload)",
    )
    p.add_argument(
        "--concurrency",
        "-c",
        type=int,
        default=None,
        help="closed loop: max requests in flight (default: unbounded)",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="open loop: Poisson arrivals per second (inf: all at once)",
    )
    p.add_argument(
        "--sweep-concurrency",
        type=_concurrency_list,
        default=None,
        help="repeat the run at each level, e.g. 1,4,16,64 (plots a sweep)",
    )
    p.add_argument("--warmup", type=int, default=1, help="warm-up requests, excluded")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send the `ignore_eos` extension (vLLM, pytgi) for exact output lengths",
    )
    p.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="METRIC:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument(
        "--http-client",
        choices=HTTP_CLIENTS,
        default="raw",
        help="raw: lean built-in HTTP/1.1 streaming client (http:// only); httpx: httpx",
    )
    p.add_argument("--out", type=Path, default=None, help="write results JSON here")
    p.add_argument("--no-plots", action="store_true", help="with --out: skip the PNG plots")
    p.add_argument(
        "--summary-only", action="store_true", help="with --out: leave per-request timings out"
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--strict", action="store_true", help="exit 1 if any request failed")


def _settings(args: argparse.Namespace) -> LoadSettings:
    return LoadSettings(
        url=args.url,
        api=args.api,
        model=args.model,
        input_len=args.input_len,
        output_len=args.output_len,
        prompts_file=args.prompts_file,
        tokenizer=args.tokenizer,
        num_requests=args.num_requests,
        duration_s=args.duration,
        concurrency=args.concurrency,
        request_rate=args.request_rate,
        warmup=args.warmup,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        slo_ms=parse_slo(args.goodput),
        timeout_s=args.timeout,
        progress=not args.no_progress,
        api_key=args.api_key,
        http_client=args.http_client,
    )


def run_command(args: argparse.Namespace) -> int:
    from pytgi_bench.benchmark import BenchmarkError, run_benchmark
    from pytgi_bench.report import print_run, report_json, save_json

    try:
        settings = _settings(args)
    except ValueError as exc:
        print(f"pytgi-benchmark: error: {exc}", file=sys.stderr)
        return EXIT_SETUP
    levels: list[int | None] = list(args.sweep_concurrency or [settings.concurrency])
    try:
        report = run_event_loop(run_benchmark(settings, levels))
    except (BenchmarkError, FileNotFoundError, ValueError) as exc:
        print(f"pytgi-benchmark: error: {exc}", file=sys.stderr)
        return EXIT_SETUP
    for run in report.runs:
        print_run(run, sys.stdout)
    if report.workload.length_mismatches:
        print(
            f"note: {report.workload.length_mismatches} synthetic prompts missed their target "
            "token length (tokenizer merges at the cut); actual lengths are used",
            file=sys.stderr,
        )
    if args.out is not None:
        save_json(report_json(report, per_request=not args.summary_only), args.out)
        print(f"results: {args.out}", file=sys.stderr)
        if not args.no_plots:
            _save_plots(report, args.out, sweep=args.sweep_concurrency is not None)
    completed = sum(run.summary.completed for run in report.runs)
    failed = sum(run.summary.failed for run in report.runs)
    if completed == 0:
        first = next(iter(report.runs[0].summary.errors), "no request completed")
        print(f"pytgi-benchmark: error: every request failed: {first}", file=sys.stderr)
        return EXIT_FAILED
    if failed and args.strict:
        print(f"pytgi-benchmark: error: {failed} requests failed", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _save_plots(report, out: Path, sweep: bool) -> None:  # type: ignore[no-untyped-def]
    from pytgi_bench.plots import plot_latency_cdfs, plot_sweep

    model = (report.server_info or {}).get("model_id") or report.settings.url
    title = f"{model} ({report.settings.api} API, {report.settings.input_len} in / "
    title += f"{report.settings.output_len} out)"
    paths = [plot_latency_cdfs(report.runs, out.with_suffix(".cdf.png"), title)]
    if sweep:
        paths.append(plot_sweep(report.runs, out.with_suffix(".sweep.png"), title))
    for path in paths:
        print(f"plot: {path}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pytgi-benchmark",
        description="Benchmark a TGI-compatible endpoint over HTTP, or pytgi's shards over gRPC.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run_parser(sub)
    from pytgi_bench.shard_cli import add_shards_parser

    add_shards_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "run":
        return run_command(args)
    from pytgi_bench.shard_cli import shards_command

    return shards_command(args)


if __name__ == "__main__":
    sys.exit(main())

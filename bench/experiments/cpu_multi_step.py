"""Multi-step decode on the CPU, end to end: pytgi servers that differ only in
`--max-decode-steps`, side by side, on the workload of `pytgi_bench.compare.llama_cpp` (issue 34).

    python -m pytgi_bench.experiments.cpu_multi_step --steps 1,8 --rounds 3 \
        --out bench/results/cpu/multi_step.json

Per server and round: 64 prompts of U[16, 64) tokens at once (output tok/s, TTFT p50), then
single stream (decode tok/s = 1000 / TPOT p50, TTFT p50), 64 new tokens, greedy, EOS ignored,
each with the CPU time the server's processes spent per output token (robust to the neighbours'
load, which wall times are not); then the price of k: the TTFT p50 of single requests sent one at a time while another stream
decodes (a newcomer cuts the Decode call in flight short: it waits for the step in progress,
not the call's end; the calls cut short are counted from the server's /metrics). With
`--arrival-rate R`, also an open loop: the concurrent prompts arriving as a Poisson process of R
requests/s (newcomers keep cutting calls short): output tok/s, TTFT and TPOT p50. Rounds
alternate the servers' order; every round is kept, with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from pytgi_bench.benchmark import run_benchmark
from pytgi_bench.compare.llama_cpp import _load
from pytgi_bench.compare.llama_cpp_build import DEMO_MODEL
from pytgi_bench.compare.run import build_prompts
from pytgi_bench.compare.server_process import PytgiServer
from pytgi_bench.settings import LengthRange, LoadSettings
from pytgi_router.server import run_event_loop

REPO = Path(__file__).resolve().parents[2]


def tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system) the process `root` (the launcher) and its descendants (the
    router and the shards) used so far. Under a loaded machine's contention this moves far less
    than wall times do: the work per token, not the wait for a core."""
    ticks = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    used: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        parent[int(entry)] = int(fields[1])  # ppid
        used[int(entry)] = int(fields[11]) + int(fields[12])  # utime, stime
    total = 0
    for pid, ticks_used in used.items():
        up = pid
        while up > 1 and up != root:
            up = parent.get(up, 0)
        if up == root:
            total += ticks_used
    return total / ticks


def one_round(server: PytgiServer, concurrent: list[str], single: list[str],
              new_tokens: int, work: Path, name: str) -> dict[str, float]:
    """The round's numbers for one server (the fields of compare.llama_cpp.one_round, plus the
    server's CPU ms per output token in each part)."""
    root = int(server.pid_path.read_text())  # the launcher's pid
    cpu = tree_cpu_s(root)
    batch = _load(server.url, concurrent, new_tokens, None, work, f"{name}.concurrent")
    cpu, batch_cpu = tree_cpu_s(root), tree_cpu_s(root) - cpu
    stream = _load(server.url, single, new_tokens, 1, work, f"{name}.single")
    stream_cpu = tree_cpu_s(root) - cpu
    return {
        "concurrent_output_tok_s": batch.total_output_tokens / batch.duration_s,
        "concurrent_output_tokens": batch.total_output_tokens,
        "concurrent_ttft_p50_ms": batch.ttft.p50_ms,
        "concurrent_cpu_ms_per_token": batch_cpu * 1e3 / batch.total_output_tokens,
        "single_decode_tok_s": 1000.0 / stream.tpot.p50_ms,
        "single_tpot_p50_ms": stream.tpot.p50_ms,
        "single_ttft_p50_ms": stream.ttft.p50_ms,
        "single_cpu_ms_per_token": stream_cpu * 1e3 / stream.total_output_tokens,
    }


def busy_ttft_ms(url: str, prompts: list[str], work: Path, name: str) -> float:
    """TTFT p50 of `prompts`, one at a time, while a background stream keeps decoding (it is
    restarted until the probe is done: the demo model's context is short)."""
    done = threading.Event()

    def background() -> None:
        with httpx.Client(timeout=120) as http:
            while not done.is_set():
                http.post(f"{url}/v1/completions", json={
                    "model": "demo", "prompt": prompts[0], "max_tokens": 150,
                    "temperature": 0.0, "ignore_eos": True})

    thread = threading.Thread(target=background, daemon=True)
    thread.start()
    time.sleep(0.3)
    try:
        summary = _load(url, prompts, 4, 1, work, name)
    finally:
        done.set()
        thread.join()
    return float(summary.ttft.p50_ms)


def open_loop(url: str, prompts: list[str], new_tokens: int, rate: float, work: Path,
              name: str) -> dict[str, float]:
    """`prompts` arriving at `rate` requests/s (Poisson, seeded): output tok/s, TTFT and TPOT
    p50, and the calls cut short meanwhile."""
    path = work / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "max_new_tokens": new_tokens}) + "\n"
                            for p in prompts))
    settings = LoadSettings(url=url, api="openai-completions", model="demo", prompts_file=path,
                            tokenizer=DEMO_MODEL, num_requests=len(prompts), request_rate=rate,
                            warmup=0, progress=False, ignore_eos=True, seed=34)
    cuts = cut_short_calls(url)
    (run,) = run_event_loop(run_benchmark(settings)).runs
    summary = run.summary
    if summary.failed:
        raise RuntimeError(f"{name}: {summary.failed} requests failed: {summary.errors}")
    return {"open_loop_output_tok_s": summary.total_output_tokens / summary.duration_s,
            "open_loop_ttft_p50_ms": summary.ttft.p50_ms,
            "open_loop_tpot_p50_ms": summary.tpot.p50_ms,
            "open_loop_calls_cut_short": cut_short_calls(url) - cuts}


def cut_short_calls(url: str) -> float:
    """pytgi_decode_calls_cut_short_total on the server's /metrics (0 if absent)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("pytgi_decode_calls_cut_short_total "):
            return float(line.split()[1])
    return 0.0


def workload_args(parser: argparse.ArgumentParser) -> None:
    """The issue's workload's options, shared by the CPU experiments that run servers side by
    side (this one, cpu_graphs)."""
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--single", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)


def workload_prompts(args: argparse.Namespace) -> tuple[list[str], list[str], list[str]]:
    """The concurrent prompts, the single-stream ones and 4 for an untimed warm-up: U[16, 64)
    tokens, seed 34, as pytgi_bench.compare.llama_cpp draws them."""
    prompts = [t for t, _ in build_prompts(DEMO_MODEL, args.requests + args.single + 4,
                                           LengthRange(16, 64), seed=34)]
    return (prompts[:args.requests], prompts[args.requests:args.requests + args.single],
            prompts[-4:])


def save(result: dict[str, Any], out: Path | None) -> None:
    """The run's JSON at `out` (nothing when None)."""
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", default="1,8", help="--max-decode-steps of each server")
    workload_args(parser)
    parser.add_argument("--arrival-rate", type=float, default=0.0,
                        help="requests/s of the open-loop part (0: not run)")
    parser.add_argument("--pytgi-args", default="")
    parser.add_argument("--work-dir", type=Path, default=REPO / "build" / "multi-step")
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    steps = [int(s) for s in args.steps.split(",")]
    concurrent, single, warm = workload_prompts(args)
    servers = {k: PytgiServer(DEMO_MODEL, args.work_dir / f"pytgi-k{k}.log", threads=args.threads,
                              extra_args=[*args.pytgi_args.split(), "--max-decode-steps", str(k)])
               for k in steps}
    rounds: list[dict[str, Any]] = []
    loads: list[float] = []
    started = []
    try:
        for server in servers.values():
            server.__enter__()
            started.append(server)
        for k, server in servers.items():
            _load(server.url, warm, args.new_tokens, None, args.work_dir, f"k{k}.warm")
        for index in range(args.rounds):
            order = steps if index % 2 == 0 else steps[::-1]
            row: dict[str, Any] = {}
            for k in order:
                url = servers[k].url
                numbers = one_round(servers[k], concurrent, single, args.new_tokens,
                                    args.work_dir, f"k{k}")
                cuts = cut_short_calls(url)
                numbers["busy_ttft_p50_ms"] = busy_ttft_ms(url, single, args.work_dir,
                                                           f"k{k}.busy")
                numbers["busy_calls_cut_short"] = cut_short_calls(url) - cuts
                if args.arrival_rate > 0:
                    numbers.update(open_loop(url, concurrent, args.new_tokens,
                                             args.arrival_rate, args.work_dir, f"k{k}.open"))
                row[str(k)] = numbers
            loads.append(os.getloadavg()[0])
            rounds.append(row)
            print(f"round {index + 1} (load {loads[-1]:.1f}): {json.dumps(row)}", flush=True)
    finally:
        for server in reversed(started):
            server.__exit__(None, None, None)
    medians = {str(k): {key: statistics.median(r[str(k)][key] for r in rounds)
                        for key in rounds[0][str(k)]} for k in steps}
    result = {"issue": 34, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "load_average_per_round": loads, "threads": args.threads,
              "pytgi_args": args.pytgi_args, "steps": steps,
              "workload": {"requests": args.requests, "prompt_tokens": [16, 64],
                           "new_tokens": args.new_tokens, "single": args.single},
              "rounds": rounds, "medians": medians}
    print(json.dumps(medians, indent=1))
    save(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

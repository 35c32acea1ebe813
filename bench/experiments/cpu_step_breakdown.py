"""Where a CPU decode step's time goes at batch 1 and batch 64, end to end (issue 34).

    python -m pytgi_bench.experiments.cpu_step_breakdown --rounds 3 \
        --out bench/results/cpu/step_breakdown.json

One `pytgi-launcher` on the demo model (`--step-timeline`), driven over HTTP by the load tool
with the workload of `pytgi_bench.compare.llama_cpp` (64 prompts of U[16, 64) tokens at once,
then single-stream prompts, 64 new tokens each, greedy, EOS ignored). Per batch size, the
decode steps' medians from the shard's step timeline:

- forward: the model's forward (on the CPU, the whole computation);
- shard host: the rest of the shard's step (build, choose, sync, emit, reply:
  shard/engine/step_timeline.py);
- gap: between the end of one step and the start of the next on the shard: the router's
  per-step work plus the gRPC round trip;
- of which gRPC: the median round trip of an empty unary call (`Info`) on the shard's unix
  socket from a grpc.aio client, as the router's, measured between the load runs.

Rounds alternate with the machine's neighbours' load; every round's numbers are kept.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import grpc

from pytgi_bench.compare.llama_cpp import _load
from pytgi_bench.compare.llama_cpp_build import DEMO_MODEL
from pytgi_bench.compare.run import build_prompts
from pytgi_bench.compare.server_process import PytgiServer, wait_compiled
from pytgi_bench.compare.timeline_summary import read_timeline, summarize, within
from pytgi_bench.settings import LengthRange
from pytgi_proto import generate_pb2, generate_pb2_grpc
from pytgi_proto.contracts import shard_socket

REPO = Path(__file__).resolve().parents[2]


async def empty_rpc_ms(socket: str, calls: int) -> float:
    """Median ms of an `Info` call (no engine work) over a grpc.aio channel, as the router's."""
    async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
        stub = generate_pb2_grpc.TextGenerationServiceStub(channel)
        times = []
        for _ in range(calls):
            start = time.perf_counter_ns()
            await stub.Info(generate_pb2.InfoRequest())
            times.append((time.perf_counter_ns() - start) / 1e6)
    return statistics.median(times[5:])


def decode_row(records: list[dict[str, Any]]) -> dict[str, float]:
    """The decode steps' medians (ms) of a window: step, forward, shard host, gap."""
    decode = summarize(records)["kinds"].get("decode")
    if decode is None:
        return {}
    phases = decode["phases"]
    host = sum(phases[p]["p50_ms"] for p in ("build", "choose", "sync", "emit", "reply"))
    return {"steps": decode["steps"], "batch_p50": decode["requests_p50"],
            "step_ms": decode["step_ms"]["p50"], "forward_ms": phases["forward"]["p50_ms"],
            "shard_host_ms": host, "gap_ms": phases["gap"]["p50_ms"],
            **{f"{p}_ms": phases[p]["p50_ms"] for p in ("build", "choose", "emit", "reply")}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--single", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pytgi-args", default="")
    parser.add_argument("--work-dir", type=Path, default=REPO / "build" / "step-breakdown")
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    prompts = [t for t, _ in build_prompts(DEMO_MODEL, args.requests + args.single + 4,
                                           LengthRange(16, 64), seed=34)]
    concurrent, single = prompts[:args.requests], prompts[args.requests:-4]
    timeline = args.work_dir / "timeline.jsonl"
    timeline.unlink(missing_ok=True)
    server = PytgiServer(DEMO_MODEL, args.work_dir / "pytgi.log", threads=args.threads,
                         extra_args=[*args.pytgi_args.split(), "--step-timeline", str(timeline)])
    windows: list[tuple[str, int, int]] = []
    rpc: list[float] = []
    with server:
        if "--cpu-graphs" in args.pytgi_args:
            wait_compiled(server)  # time the compiled steps, not the eager ones before them
        socket = shard_socket(server._uds, 0)
        _load(server.url, prompts[-4:], args.new_tokens, None, args.work_dir, "warm")
        for _ in range(args.rounds):
            for name, batch, concurrency in (("b64", concurrent, None), ("b1", single, 1)):
                start = time.perf_counter_ns()
                _load(server.url, batch, args.new_tokens, concurrency, args.work_dir, name)
                windows.append((name, start, time.perf_counter_ns()))
                rpc.append(asyncio.run(empty_rpc_ms(socket, 105)))
    records = read_timeline(timeline)
    rows: dict[str, list[dict[str, float]]] = {"b1": [], "b64": []}
    for name, start, end in windows:
        rows[name].append(decode_row(within(records, start, end)))
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
               for name, rs in rows.items()}
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "load_average": list(os.getloadavg()), "pytgi_args": args.pytgi_args,
              "empty_rpc_ms": {"median": statistics.median(rpc), "all": rpc},
              "rounds": rows, "medians": medians}
    print(json.dumps({"empty_rpc_ms": result["empty_rpc_ms"]["median"], "medians": medians},
                     indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

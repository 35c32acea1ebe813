"""Compiled CPU decode steps (--cpu-graphs), end to end: pytgi servers that differ only in their
flags, side by side, on the workload of `pytgi_bench.compare.llama_cpp` (issue 34).

    python -m pytgi_bench.experiments.cpu_graphs --rounds 3 \
        --variants "eager=;graphs=--cpu-graphs 1,2,4,8,16,32,64" \
        --out bench/results/cpu/cpu_graphs.json

Each variant is a name and the extra launcher flags of its server. Per server and round the
numbers of `cpu_multi_step.one_round` (64 concurrent, single stream, CPU ms per token) and the
TTFT of a newcomer while another stream decodes. Rounds alternate the servers' order; the start
time of each server (its compile, cold or from inductor's on-disk cache) is kept too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from pytgi_bench.compare.llama_cpp import _load
from pytgi_bench.compare.llama_cpp_build import DEMO_MODEL
from pytgi_bench.compare.server_process import PytgiServer, wait_compiled
from pytgi_bench.experiments.cpu_multi_step import (
    busy_ttft_ms,
    one_round,
    save,
    workload_args,
    workload_prompts,
)

REPO = Path(__file__).resolve().parents[2]


def variants(text: str) -> dict[str, list[str]]:
    """"name=flags;name=flags" as {name: argv}."""
    out = {}
    for part in text.split(";"):
        name, _, flags = part.partition("=")
        out[name.strip()] = flags.split()
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="eager=;graphs=--cpu-graphs 1,2,4,8,16,32,64")
    workload_args(parser)
    parser.add_argument("--work-dir", type=Path, default=REPO / "build" / "cpu-graphs")
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    flags = variants(args.variants)
    concurrent, single, warm = workload_prompts(args)
    servers = {name: PytgiServer(DEMO_MODEL, args.work_dir / f"pytgi-{name}.log",
                                 threads=args.threads, extra_args=argv_)
               for name, argv_ in flags.items()}
    rounds: list[dict[str, Any]] = []
    loads: list[float] = []
    start_s: dict[str, float] = {}
    started = []
    try:
        for name, server in servers.items():
            t0 = time.perf_counter()
            server.__enter__()
            start_s[name] = time.perf_counter() - t0
            started.append(server)
            if "--cpu-graphs" in flags[name]:
                start_s[f"{name}_compile"] = wait_compiled(server)
            _load(server.url, warm, args.new_tokens, None, args.work_dir, f"{name}.warm")
        names = list(servers)
        for index in range(args.rounds):
            row: dict[str, Any] = {}
            for name in names if index % 2 == 0 else names[::-1]:
                numbers = one_round(servers[name], concurrent, single, args.new_tokens,
                                    args.work_dir, name)
                numbers["busy_ttft_p50_ms"] = busy_ttft_ms(servers[name].url, single,
                                                           args.work_dir, f"{name}.busy")
                row[name] = numbers
            loads.append(os.getloadavg()[0])
            rounds.append(row)
            print(f"round {index + 1} (load {loads[-1]:.1f}): {json.dumps(row)}", flush=True)
    finally:
        for server in reversed(started):
            server.__exit__(None, None, None)
    medians = {name: {key: statistics.median(r[name][key] for r in rounds)
                      for key in rounds[0][name]} for name in servers}
    result = {"issue": 34, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "load_average_per_round": loads, "threads": args.threads,
              "variants": args.variants, "start_s": start_s,
              "workload": {"requests": args.requests, "prompt_tokens": [16, 64],
                           "new_tokens": args.new_tokens, "single": args.single},
              "rounds": rounds, "medians": medians}
    print(json.dumps({"start_s": start_s, "medians": medians}, indent=1))
    save(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

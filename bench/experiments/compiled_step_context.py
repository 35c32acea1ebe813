"""What a compiled CPU decode step (--cpu-graphs) costs by context, three ways (issue 34).

    python -m pytgi_bench.experiments.compiled_step_context --batch-sizes 1,8,64 \
        --out bench/results/cpu/compiled_step_context.json

One bucket of the demo model's decode forward, in-process, compiled as
shard/engine/cpu_graphs.py compiles it, over a 256-token static context (the demo server's
max_total_tokens), three ways:
- `static`: the context fixed at 256 positions, attention as gathered SDPA (the compiled step
  before the block tables' width became a free size);
- `free, sdpa`: the width free, each call attending the positions asked, gathered SDPA;
- `free, fused`: the width free, decode attention as reductions over the cache read through the
  block table (shard/attention/compiled_decode.py): what --cpu-graphs compiles now.
Each call's rows have as many positions as the column says (every row the same); best of three
runs of `--calls` calls. A probe: nothing here changes the shard.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

DEMO_MODEL = Path(__file__).resolve().parents[2] / "launcher" / "demo_model"
CONTEXT = 256
POSITIONS = (48, 96, 128, 192, 256)


def best_ms(call: Callable[[], object], calls: int) -> float:
    """The fastest of three runs of `calls` calls, per call, after a warm-up."""
    for _ in range(10):
        call()
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        runs.append((time.perf_counter() - start) / calls * 1e3)
    return min(runs)


def measure(engine: Any, bucket: int, calls: int) -> dict[str, Any]:
    """The three compiled steps of `bucket`, timed at each of POSITIONS."""
    import torch

    from pytgi_shard.engine.cpu_graphs import FreeSize, compile_step
    from pytgi_shard.engine.decode_graphs import _TABLES, DecodeGraphRunner, _Buffers, _fields

    runner, kv, block = engine.runner, engine.runner.kv_cache, engine.runner.block_size
    graphs = DecodeGraphRunner(runner.model, [bucket], CONTEXT // block, block)
    traced = _fields(_Buffers.allocate(bucket, CONTEXT // block, runner.model.device))

    plain, fused = graphs.traced_forward(bucket, False), graphs.traced_forward(bucket, True)
    steps = {
        "static": (compile_step(plain, kv, traced), False),
        "free, sdpa": (compile_step(plain, kv, traced, FreeSize(_TABLES, 1)), True),
        "free, fused": (compile_step(fused, kv, traced, FreeSize(_TABLES, 1)), True),
    }
    live = graphs._buffers
    for row in range(bucket):
        first = 1 + row * (CONTEXT // block)
        live.block_tables[row].copy_(torch.arange(first, first + CONTEXT // block))
    result: dict[str, Any] = {}
    for positions in POSITIONS:
        live.seqlens_k[:bucket].fill_(positions)
        blocks = -(-positions // block)
        result[str(positions)] = {
            name: best_ms(partial(step, kv, _fields(live), blocks if free else None), calls)
            for name, (step, free) in steps.items()}
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", default="1,8,64")
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    import torch

    from pytgi_proto import generate_pb2
    from pytgi_shard.service.startup import load_engine
    from pytgi_shard.settings import ShardSettings

    torch.set_num_threads(args.threads)
    engine = load_engine(ShardSettings(model_path=DEMO_MODEL))
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    engine.warmup(generate_pb2.WarmupRequest(
        max_input_tokens=CONTEXT - 64, max_total_tokens=CONTEXT, max_prefill_tokens=4096,
        max_batch_total_tokens=max(sizes) * CONTEXT + 1024, max_batch_size=max(sizes)))
    rows = {str(size): measure(engine, size, args.calls) for size in sizes}
    command = "python -m pytgi_bench.experiments.compiled_step_context " + " ".join(
        argv if argv is not None else sys.argv[1:])
    print(f"# {command}")
    print(f"# demo model, {args.threads} threads, load {os.getloadavg()[0]:.2f}; ms a step")
    print("| batch | positions | static (256) | free, sdpa | free, fused |")
    print("|---|---|---|---|---|")
    for size, by_positions in rows.items():
        for positions, ms in by_positions.items():
            print(f"| {size} | {positions} | {ms['static']:.2f} | {ms['free, sdpa']:.2f} "
                  f"| {ms['free, fused']:.2f} |")
    if args.out is not None:
        args.out.write_text(json.dumps({"issue": 34, "command": command, "threads": args.threads,
                                        "load_average": os.getloadavg(), "ms": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

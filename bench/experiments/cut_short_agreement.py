"""What the ranks' agreement on cutting a multi-step call short costs (shard/engine/cut_short.py):
on two tensor-parallel ranks, every step after a call's first all-reduces a one-element flag
(gloo on the CPU). Two engines on the demo model, one process each as `pytgi-shard serve` runs
them, time Decode calls of k steps with a call id (the agreement runs, the flag never set) and
without (call id 0: no agreement), interleaved call by call.

    python -m pytgi_bench.experiments.cut_short_agreement --batch 1,16 --calls 40

Prints, per batch size, the median time per step of each kind and the difference, with the load
average (the machine is shared: medians of interleaved calls).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from pytgi_bench.compare.llama_cpp_build import DEMO_MODEL
from pytgi_bench.experiments.cpu_multi_step import save
from pytgi_proto import generate_pb2 as pb
from pytgi_shard.engine.cut_short import CutShort
from pytgi_shard.engine.multi_step import decode_steps
from pytgi_shard.service.startup import load_engine
from pytgi_shard.settings import ShardSettings

BLOCK = 16


def _batch(size: int, new_tokens: int) -> pb.Batch:
    """`size` greedy requests of 16-token prompts, blocks for their whole life."""
    per = math.ceil((16 + new_tokens) / BLOCK)
    return pb.Batch(id=1, requests=[
        pb.Request(id=i, input_ids=[(7 * i + j) % 4000 + 3 for j in range(16)],
                   parameters=pb.NextTokenChooserParameters(),
                   stopping_parameters=pb.StoppingCriteriaParameters(
                       max_new_tokens=new_tokens, ignore_eos_token=True),
                   blocks=list(range(1 + i * per, 1 + (i + 1) * per)))
        for i in range(size)])


def _rank(rank: int, port: int, batches: list[int], calls: int, steps: int, out: Path) -> None:
    torch.set_num_threads(1)
    engine = load_engine(ShardSettings(model_path=DEMO_MODEL, block_size=BLOCK, rank=rank,
                                       world_size=2, master_port=port))
    cut = CutShort()
    result: dict[str, dict[str, float]] = {}
    try:
        engine.warmup(pb.WarmupRequest(max_prefill_tokens=1024, max_batch_total_tokens=65536))
        for size in batches:
            times: dict[str, list[float]] = {"agreed": [], "plain": []}
            call_id = 1
            # Each round: a fresh batch, then calls alternating with and without a call id.
            new_tokens = 200
            engine.clear(None)
            cached = engine.prefill(pb.PrefillRequest(batch=_batch(size, new_tokens))).batch
            done = 0
            for index in range(calls):
                if done + steps >= new_tokens - 1:
                    engine.clear(None)
                    cached = engine.prefill(pb.PrefillRequest(batch=_batch(size, new_tokens))).batch
                    done = 0
                kind = "agreed" if index % 2 == 0 else "plain"
                call_id += 1
                request = pb.DecodeRequest(batches=[cached], max_steps=steps,
                                           call_id=call_id if kind == "agreed" else 0)
                start = time.perf_counter()
                answer = decode_steps(engine, request, cut)
                times[kind].append((time.perf_counter() - start) / len(answer.step_sizes))
                cached = answer.batch
                done += len(answer.step_sizes)
            agreed = statistics.median(times["agreed"]) * 1e3
            plain = statistics.median(times["plain"]) * 1e3
            result[str(size)] = {"agreed_ms_per_step": agreed, "plain_ms_per_step": plain,
                                 "difference_us_per_step": (agreed - plain) * 1e3}
        if rank == 0:
            (out / "agreement.json").write_text(json.dumps(result))
    finally:
        engine.dist.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", default="1,16", help="batch sizes")
    parser.add_argument("--calls", type=int, default=40, help="Decode calls per batch size")
    parser.add_argument("--steps", type=int, default=8, help="steps per call")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]
    work = Path(os.environ.get("TMPDIR", "/tmp"))
    before = os.getloadavg()[0]
    mp.spawn(_rank, args=(_free_port(), batches, args.calls, args.steps, work), nprocs=2,
             join=True)
    result = json.loads((work / "agreement.json").read_text())
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "load_average": [before, os.getloadavg()[0]], "steps_per_call": args.steps,
              "calls": args.calls, "by_batch": result}
    print(json.dumps(report, indent=1))
    save(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

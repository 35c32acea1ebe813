"""Engine step timing in-process: where a decode step's time goes, per batch size.

For each batch size, a batch of `--input-len`-token prompts is prefilled, then decoded for
`--steps` steps by calling the shard Engine's Prefill/Decode directly (no gRPC, no router). Per
step it reports the whole call, the model forward the engine measured, and the rest: the
overhead outside the forward (sampling, stopping, detokenization, batch bookkeeping, protobuf)
that the GPU would sit idle for without overlap. With `--overlap both` (default) the same engine
is measured with the overlap scheduler off, then on. With `--timeline on` (default) the
engine's step timeline (shard/engine/step_timeline.py) records every step and each row carries
its summary per step kind (bench/compare/timeline_summary.py); `--timeline both` measures every
row without it, then with it: the timeline's overhead. Prints a table and the command; `--out`
saves JSON.

    python -m pytgi_bench.compare.engine_steps --model DIR --batch-sizes 1,64,256 --steps 32
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pytgi_bench.compare.timeline_summary import print_summary, summarize
from pytgi_proto import generate_pb2

_FIRST_PLAIN_ID = 3


@dataclass(slots=True)
class StepRow:
    overlap: bool
    batch_size: int
    prefill_ms: float
    decode_ms: float
    forward_ms: float
    overhead_ms: float
    tokens_per_s: float
    # The step timeline's summary of the measured steps (None: measured without it).
    timeline: dict[str, Any] | None = None


def _batch(batch_id: int, size: int, input_len: int, new_tokens: int, vocab: int,
           block_size: int) -> generate_pb2.Batch:
    blocks_per = math.ceil((input_len + new_tokens) / block_size)
    requests = []
    for i in range(size):
        first = 1 + i * blocks_per
        requests.append(generate_pb2.Request(
            id=i,
            input_ids=[_FIRST_PLAIN_ID + (7 * i + 13 * j) % (vocab - _FIRST_PLAIN_ID)
                       for j in range(input_len)],
            parameters=generate_pb2.NextTokenChooserParameters(),
            stopping_parameters=generate_pb2.StoppingCriteriaParameters(
                max_new_tokens=new_tokens, ignore_eos_token=True),
            blocks=list(range(first, first + blocks_per)),
        ))
    return generate_pb2.Batch(id=batch_id, requests=requests, size=size)


def _sync(engine) -> None:  # type: ignore[no-untyped-def]
    import torch

    if engine.model.device.type == "cuda":
        torch.cuda.synchronize(engine.model.device)


def measure(engine, size: int, input_len: int, steps: int) -> StepRow:  # type: ignore[no-untyped-def]
    """Prefill one batch of `size`, then `steps` Decode calls; medians per step."""
    batch = _batch(size, size, input_len, steps + 2, engine.model.vocab_size, engine.block_size)
    engine.clear(None)
    _sync(engine)
    if engine.timeline is not None:
        engine.timeline.drain()  # steps before this measurement's
    start = time.perf_counter()
    response = engine.prefill(generate_pb2.PrefillRequest(batch=batch))
    _sync(engine)
    prefill_s = time.perf_counter() - start
    calls, forwards = [], []
    cached = response.batch
    for _ in range(steps):
        start = time.perf_counter()
        response = engine.decode(generate_pb2.DecodeRequest(batches=[cached]))
        _sync(engine)
        calls.append(time.perf_counter() - start)
        forwards.append(response.forward_ns / 1e9)
        cached = response.batch
    engine.clear(None)
    call, forward = statistics.median(calls), statistics.median(forwards)
    row = StepRow(engine.overlap, size, prefill_s * 1e3, call * 1e3, forward * 1e3,
                  (call - forward) * 1e3, size / call)
    if engine.timeline is not None:
        from pytgi_shard.engine.step_timeline import as_records

        row.timeline = summarize(as_records(engine.timeline.drain()))
    return row


def measure_all(engine, sizes: list[int], input_len: int, steps: int,  # type: ignore[no-untyped-def]
                overlaps: tuple[bool, ...], timelines: tuple[bool, ...]) -> list[StepRow]:
    """Every batch size under each overlap setting, and each timeline setting inside it (so
    the rows with and without the timeline are measured close together)."""
    from pytgi_shard.engine.step_timeline import StepTimeline

    rows = []
    for overlap in overlaps:
        engine.overlap = overlap
        for timeline in timelines:
            engine.timeline = StepTimeline() if timeline else None
            measure(engine, min(sizes), input_len, 4)  # untimed: first-call costs
            rows += [measure(engine, s, input_len, steps) for s in sizes]
    return rows


def record_cost_ns(samples: int = 100_000) -> float:
    """What recording one step costs the engine's thread (StepTimeline.record), in ns: the
    timeline's whole per-step price beyond the stamps the engine takes anyway."""
    from pytgi_shard.engine.step_timeline import StepClock, StepTimeline

    timeline, clock = StepTimeline(1024), StepClock()
    clock.begin(time.perf_counter_ns(), 2)
    start = time.perf_counter_ns()
    for _ in range(samples):
        timeline.record(clock, start)
    return (time.perf_counter_ns() - start) / samples


def _warmup(engine, max_batch: int, input_len: int) -> None:  # type: ignore[no-untyped-def]
    tokens = max_batch * (input_len + 64)
    engine.warmup(generate_pb2.WarmupRequest(
        max_input_tokens=input_len, max_total_tokens=input_len + 64,
        max_prefill_tokens=min(tokens, 8192), max_batch_total_tokens=tokens + 64 * 16,
        max_batch_size=max_batch))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pytgi_bench.compare.engine_steps", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--dtype", default=None)
    p.add_argument("--attention", default="reference")
    p.add_argument("--batch-sizes", default="1,64,256")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    p.add_argument("--overlap", choices=("both", "on", "off"), default="both",
                   help="the overlap scheduler: measure with it on, off, or both (one engine)")
    p.add_argument("--timeline", choices=("both", "on", "off"), default="on",
                   help="the step timeline: recorded (each row's summary in the JSON), not "
                   "recorded, or both (its overhead)")
    p.add_argument("--cpu-graphs", default="0",
                   help="on a CPU, the decode batch sizes to compile (shard --cpu-graphs)")
    p.add_argument("--extra", default="", help="more ShardSettings as k=v,k=v")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    import torch

    from pytgi_shard.service.startup import load_engine
    from pytgi_shard.settings import ShardSettings, parse_cuda_graphs

    if args.threads:
        torch.set_num_threads(args.threads)
    extra = dict(kv.split("=", 1) for kv in args.extra.split(",") if kv)
    settings = ShardSettings(model_path=args.model, dtype=args.dtype, attention=args.attention,
                             cpu_graphs=parse_cuda_graphs(args.cpu_graphs, "--cpu-graphs"),
                             **extra)  # type: ignore[arg-type]
    engine = load_engine(settings)
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    _warmup(engine, max(sizes), args.input_len)
    graphs = engine.runner.decode_graphs
    if graphs is not None and graphs.compiling is not None:
        graphs.compiling.join()  # --cpu-graphs compile after Warmup: time the compiled steps
    choice = {"both": (False, True), "on": (True,), "off": (False,)}
    rows = measure_all(engine, sizes, args.input_len, args.steps, choice[args.overlap],
                       choice[args.timeline])
    command = "python -m pytgi_bench.compare.engine_steps " + shlex.join(argv or sys.argv[1:])
    print(f"# {command}")
    print(f"# device {engine.model.device}, dtype {engine.model.dtype}, "
          f"attention {args.attention}, prompt {args.input_len} tokens, {args.steps} steps")
    # With overlap the forward of a step ran during the previous call: "busy" is the share of
    # a Decode call's wall time the device spent in forwards (1 - the idle fraction).
    print("| overlap | timeline | batch | prefill ms | decode step ms | forward ms "
          "| outside forward ms | busy | tok/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {'on' if r.overlap else 'off'} | {'on' if r.timeline else 'off'} | "
              f"{r.batch_size} | {r.prefill_ms:.2f} | {r.decode_ms:.3f} | {r.forward_ms:.3f} | "
              f"{r.overhead_ms:.3f} | {min(r.forward_ms / r.decode_ms, 1):.0%} | "
              f"{r.tokens_per_s:,.0f} |")
    cost = record_cost_ns()
    print(f"# step timeline: recording a step costs {cost:.0f} ns on this machine")
    for r in rows:
        if r.timeline is not None:
            print_summary(r.timeline, f"overlap {'on' if r.overlap else 'off'}, batch "
                          f"{r.batch_size}", sys.stdout)
    if args.out:
        args.out.write_text(json.dumps({"command": command, "record_ns": cost,
                                        "rows": [asdict(r) for r in rows]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

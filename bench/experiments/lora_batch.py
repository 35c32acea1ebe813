"""Multi-LoRA throughput: a batch of 64 requests spread over 8 rank-16 adapters (every projection
adapted) against the same batch on the base model alone, through the shard's Engine (Prefill,
then Decode to the end, as the router drives it; KV blocks for each whole sequence up front).
Issue 31's bar: the adapters' tokens/s at least 0.8x the base model's.

    python -m pytgi_bench.experiments.lora_batch --out bench/results/cpu/lora_batch.json
    python -m pytgi_bench.experiments.lora_batch --model DIR ...   (gpu.sh: CUDA when present)
    python -m pytgi_bench.experiments.lora_batch --torch-path ...  (CPU: the torch ops, not the
                                                                    fused C++ kernel)

Each repeat serves the batch on both engines back to back, the order alternating (both see the
same load on a shared host); the ratio is the median over repeats of the two times' ratio, after
one untimed run of each (with --same-engine the base model's run is the adapters' engine with
every row on the base model: one model loaded, for the GPU's 8B shape). Also measured, interleaved the same way: the adapters' engine serving
the batch with every row on the base model (what loading adapters costs rows that use none).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.engine.engine import Engine
from pytgi_shard.lora.layer import LoraLinear
from pytgi_shard.service.startup import load_engine
from pytgi_shard.settings import ShardSettings
from tests.lora_adapters import write_adapter

REPO = Path(__file__).resolve().parents[2]
DEMO_MODEL = REPO / "launcher" / "demo_model"
PROMPTS = (
    "ROMEO:\nBut soft, what light through yonder window breaks?",
    "HAMLET:\nTo be, or not to be, that is the question:",
    "PORTIA:\nThe quality of mercy is not strained;",
    "MACBETH:\nTomorrow, and tomorrow, and tomorrow,",
)


def engine(model: Path, lora: str | None, custom_kernels: bool = True) -> Engine:
    out = load_engine(ShardSettings(model_path=model, lora_adapters=lora,
                                    disable_custom_kernels=not custom_kernels))
    out.warmup(pb.WarmupRequest(max_prefill_tokens=4096, max_batch_total_tokens=256 * 96,
                                max_input_tokens=128, max_total_tokens=256))
    return out


def serve(e: Engine, batch: int, adapters: int, max_new: int) -> tuple[float, int]:
    """`batch` requests, request i under adapter i % adapters + 1 (0 adapters: the base model),
    all at once: (seconds, generated tokens)."""
    reqs, block = [], 1
    for i in range(batch):
        ids = e.detokenizer.tokenizer.encode(PROMPTS[i % len(PROMPTS)]).ids
        count = -(-(len(ids) + max_new) // e.block_size)
        reqs.append(pb.Request(
            id=i, input_ids=ids, blocks=list(range(block, block + count)),
            adapter_index=i % adapters + 1 if adapters else 0,
            stopping_parameters=pb.StoppingCriteriaParameters(
                max_new_tokens=max_new, ignore_eos_token=True)))
        block += count
    start = time.perf_counter()
    response = e.prefill(pb.PrefillRequest(batch=pb.Batch(id=1, requests=reqs, size=len(reqs))))
    generated = len(response.generations)
    cached = response.batch if response.HasField("batch") else None
    while cached is not None:
        step = e.decode(pb.DecodeRequest(batches=[cached]))
        generated += sum(len(g.tokens.ids) for g in step.generations)
        cached = step.batch if step.HasField("batch") else None
    if e.model.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, generated


def interleaved(pair: tuple[tuple[Engine, int], tuple[Engine, int]], batch: int, max_new: int,
                repeats: int) -> dict[str, object]:
    """Both (engine, adapters) runs per repeat, order alternating: the second's time over the
    first's (its tokens/s relative to the first), median over repeats."""
    for e, n in pair:
        serve(e, batch, n, max_new)
    times: list[list[float]] = [[], []]
    cpu: list[list[float]] = [[], []]
    tokens = 0
    for rep in range(repeats):
        order = (0, 1) if rep % 2 == 0 else (1, 0)
        for k in order:
            e, n = pair[k]
            start = time.process_time()
            seconds, tokens = serve(e, batch, n, max_new)
            cpu[k].append(time.process_time() - start)
            times[k].append(seconds)
    ratios = sorted(a / b for a, b in zip(times[0], times[1], strict=True))
    cpu_ratios = sorted(a / b for a, b in zip(cpu[0], cpu[1], strict=True))
    return {"generated_tokens": tokens,
            "tokens_per_s": [round(tokens / statistics.median(t), 1) for t in times],
            "ratio": round(statistics.median(ratios), 3),
            "ratio_per_repeat": [round(r, 3) for r in ratios],
            # The same from this process's CPU seconds (time.process_time) instead of the wall
            # clock: on a shared host it leaves out the time spent waiting for a core, so it
            # varies far less between repeats (on a GPU it means little: the host mostly waits).
            "cpu_time_ratio": round(statistics.median(cpu_ratios), 3),
            "cpu_time_ratio_per_repeat": [round(r, 3) for r in cpu_ratios]}


def lora_path(e: Engine) -> str:
    model = e.model
    modules = model.modules() if isinstance(model, nn.Module) else ()
    return next((m.path for m in modules if isinstance(m, LoraLinear)), "none")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=DEMO_MODEL)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: steadier on a shared host)")
    parser.add_argument("--same-engine", action="store_true",
                        help="the base model's run is the adapters' engine with every row on "
                             "the base model (one model loaded: gpu.sh's 8B stage)")
    parser.add_argument("--torch-path", action="store_true",
                        help="the adapters' engine without custom kernels: on the CPU the torch "
                             "ops path instead of the fused C++ kernel (shard/lora/cpu_kernel.py)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
        spec = ",".join(f"a{i}=" + str(write_adapter(
            Path(tmp) / f"a{i}", args.model, rank=args.rank, alpha=32, seed=i, std=0.02,
            dtype=dtype)) for i in range(1, args.adapters + 1))
        lora = engine(args.model, spec, custom_kernels=not args.torch_path)
        base = lora if args.same_engine else engine(args.model, None)
    adapted = interleaved(((base, 0), (lora, args.adapters)), args.batch, args.max_new,
                          args.repeats)
    base_rows = None if args.same_engine else interleaved(
        ((base, 0), (lora, 0)), args.batch, args.max_new, args.repeats)
    result = {
        "command": "python -m pytgi_bench.experiments.lora_batch " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
            if k not in ("out", "same_engine", "torch_path") and v is not None
            and not (k == "model" and v == DEMO_MODEL))
        + (" --same-engine" if args.same_engine else "")
        + (" --torch-path" if args.torch_path else ""),
        "model": str(args.model.relative_to(REPO) if args.model.is_relative_to(REPO)
                     else args.model),
        "device": str(base.model.device), "torch_threads": args.threads,
        "machine": platform.machine(), "lora_path": lora_path(lora),
        # The host's load when the runs ended (1, 5, 15 min): on a shared host, how busy it was.
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "batch": args.batch, "adapters": args.adapters, "rank": args.rank,
        "max_new_tokens": args.max_new, "repeats": args.repeats,
        # tokens_per_s: [base model alone, with adapters]; ratio: adapters' tokens/s over base's.
        "adapter_rows": adapted,
        "base_rows_with_adapters_loaded": base_rows,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

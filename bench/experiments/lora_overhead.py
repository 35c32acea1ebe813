"""Which LoRA update the CPU takes, measured (shard/lora/torch_lora.py): on one layer, the base
matmul alone against the update computed three ways, rows spread evenly over the base model and
`--adapters` adapters of rank `--rank`:
- grouped: the first version's, per adapter present: gather its rows, shrink, expand, add back
  (index_select, two matmuls, index_add_: four ops per adapter, one host read per forward);
- segmented: rows padded per slot once per forward, batched matmuls over the present slots, A
  stored transposed, the expand per fused piece from its own contiguous B (the CPU's path);
- dense: every row through every slot's A and B, masked to its own (CUDA without Triton);
- kernel: the fused C++ update (shard/lora/cpu_kernel.py, the CPU's default where it builds):
  one call per layer, rows grouped by slot inside it (nothing built per forward).
Layers: the demo model's (launcher/demo_model: hidden 128) q|k|v, o, gate|up and down, and one
Llama-3-8B q|k|v (4096 -> 6144), at 64 tokens (a decode step of batch 64) and 512 (a prefill).
Each path's time and the base matmul's are taken in turns, the median of --repeat rounds.

    python -m pytgi_bench.experiments.lora_overhead --out bench/results/cpu/lora_overhead.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pytgi_shard.lora import cpu_kernel, torch_lora

# (name, in, out, pieces: output sizes of the fused projections)
LAYERS = (
    ("demo q|k|v", 128, 384, (128, 128, 128)),
    ("demo o", 128, 128, (128,)),
    ("demo gate|up", 128, 768, (384, 384)),
    ("demo down", 384, 128, (128,)),
    ("8B q|k|v", 4096, 6144, (4096, 1024, 1024)),
)


def grouped(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
            index: torch.Tensor) -> None:
    """The first version's update: per slot present, its rows gathered, shrunk, expanded and
    added back (the grouping read on the host, once per call here)."""
    for slot in torch.unique(index).tolist():
        if slot == 0:
            continue
        rows = torch.nonzero(index == slot).flatten()
        delta = (x.index_select(0, rows) @ a[slot].t()) @ bt[slot]
        out.index_add_(0, rows, delta)


def slot_tensors(k: int, n: int, pieces: tuple[int, ...], slots: int, rank: int,
                 gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot tensors in LoraLinear's layout: rank `rank` per piece, B block-diagonal."""
    count = len(pieces)
    a = torch.randn(slots, rank * count, k, generator=gen) * 0.02
    bt = torch.zeros(slots, rank * count, n)
    start = 0
    for p, size in enumerate(pieces):
        bt[:, p * rank:(p + 1) * rank, start:start + size] = torch.randn(
            slots, rank, size, generator=gen) * 0.02
        start += size
    a[0], bt[0] = 0, 0
    return a, bt


def measure(k: int, n: int, pieces: tuple[int, ...], tokens: int, adapters: int, rank: int,
            repeat: int) -> dict[str, float]:
    """Milliseconds of the base matmul and of each update path (update alone)."""
    gen = torch.Generator().manual_seed(0)
    a, bt = slot_tensors(k, n, pieces, adapters + 1, rank, gen)
    weight = torch.randn(n, k, generator=gen) * 0.02
    x = torch.randn(tokens, k, generator=gen)
    index = torch.arange(tokens) % (adapters + 1)
    out = torch.zeros(tokens, n)
    # The CPU path's storage (LoraLinear on the CPU): A transposed, B per fused piece.
    a_stored = a.transpose(1, 2).contiguous().transpose(1, 2)
    starts = [sum(pieces[:p]) for p in range(len(pieces) + 1)]
    b_pieces = [bt[:, p * rank:(p + 1) * rank, starts[p]:starts[p + 1]].contiguous()
                for p in range(len(pieces))]
    calls: dict[str, Callable[[], object]] = {
        "base": lambda: F.linear(x, weight),
        "grouped": lambda: grouped(out, x, a, bt, index),
        # The segments are built once per forward and shared by every layer: counted here.
        "segmented": lambda: torch_lora.add_segmented(
            out, x, a_stored, b_pieces, torch_lora.segments(index, adapters + 1)),
        "dense": lambda: torch_lora.add_dense(out, x, a, bt, index),
    }
    kernel = cpu_kernel.load()
    if kernel is not None:
        at = a_stored.transpose(1, 2)  # the storage itself: [slots, in, rank · pieces]
        ranks = [0] + [rank * len(pieces)] * adapters
        calls["kernel"] = lambda: kernel.add_lora(out, x, at, b_pieces, index, ranks)
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():  # warm-up
        call()
    for _ in range(repeat):
        for name, call in calls.items():
            start = time.perf_counter()
            for _ in range(5):
                call()
            samples[name].append((time.perf_counter() - start) / 5)
    result = {name: round(statistics.median(s) * 1e3, 4) for name, s in samples.items()}
    return {**result, "kernel": result.get("kernel", float("nan"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    print(f"{'layer':<13} {'tokens':>6} {'base ms':>8} {'grouped':>8} {'segmented':>9} "
          f"{'dense':>8} {'kernel':>8}  (update alone; {args.adapters} adapters of rank {args.rank})")
    with torch.inference_mode():
        for name, k, n, pieces in LAYERS:
            for tokens in (64, 512):
                ms = measure(k, n, pieces, tokens, args.adapters, args.rank, args.repeat)
                rows.append({"layer": name, "in": k, "out": n, "tokens": tokens, **ms})
                print(f"{name:<13} {tokens:>6} {ms['base']:>8.3f} {ms['grouped']:>8.3f} "
                      f"{ms['segmented']:>9.3f} {ms['dense']:>8.3f} {ms['kernel']:>8.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": "python -m pytgi_bench.experiments.lora_overhead "
                                  f"--threads {args.threads} --adapters {args.adapters} "
                                  f"--rank {args.rank} --repeat {args.repeat}",
                       "device": "cpu", "torch_threads": args.threads,
                       "unit": "milliseconds per call (the update alone, base matmul apart)",
                       "results": rows}, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()

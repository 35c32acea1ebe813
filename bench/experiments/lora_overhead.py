"""What multi-LoRA costs a linear layer: LoraLinear (rows grouped by adapter: index_select,
shrink, expand, index_add) against the base matmul alone, on one Llama-3-8B q|k|v projection
(4096 → 6144), for decode-sized (8, 64 tokens) and prefill-sized (512 tokens) inputs, with the
rows spread evenly over 0 (base only), 1 and 4 adapters of rank 16 (and 64). On the CPU in
float32 by default, on CUDA in bfloat16 when present (`--device cuda`).

    python -m pytgi_bench.experiments.lora_overhead [--device cpu|cuda] [--threads N]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pytgi_shard.lora.layer import TORCH_PATH, LoraLinear, RowAdapters

IN, OUT = 4096, 6144


class _Dense(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def _time(call: Callable[[], torch.Tensor], device: torch.device, repeat: int) -> float:
    """Median seconds of `call()` over `repeat` calls after two warm-up calls."""
    for _ in range(2):
        call()
    samples = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


def measure(device: torch.device, dtype: torch.dtype, tokens: int, adapters: int, rank: int,
            repeat: int, path: str = TORCH_PATH) -> tuple[float, float]:
    """(base ms, with-LoRA ms) for `tokens` rows spread over `adapters` adapters."""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(OUT, IN, generator=gen) * 0.02).to(device, dtype)
    n = max(adapters, 1)
    a = [(torch.randn(rank, IN, generator=gen) * 0.02).to(device, dtype) for _ in range(n)]
    b = [(torch.randn(OUT, rank, generator=gen) * 0.02).to(device, dtype) for _ in range(n)]
    rows = RowAdapters()
    layer = LoraLinear(_Dense(weight), rows, in_features=IN, out_features=OUT, slots=n + 1,
                       max_rank=rank, dtype=dtype, device=device, path=path)
    for i in range(n):
        layer.set_slot(i + 1, a[i], b[i])
    x = torch.randn(tokens, IN, generator=gen).to(device, dtype)
    index = (torch.arange(tokens) % (adapters + 1)).to(device) if adapters else None
    with torch.inference_mode():
        base = _time(lambda: F.linear(x, weight), device, repeat)

        def lora() -> torch.Tensor:
            rows.bind(index)  # once per forward in the engine, here per call: an upper bound
            return layer(x)

        with_lora = _time(lora, device, repeat)
    return base * 1e3, with_lora * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    print(f"q|k|v projection {IN}->{OUT}, {device} {dtype}; rows split evenly over the base "
          "model and the adapters; bind (grouping) counted in every call")
    print(f"{'tokens':>6} {'adapters':>8} {'rank':>4} {'base ms':>9} {'lora ms':>9} {'overhead':>8}")
    for tokens in (8, 64, 512):
        for adapters, rank in ((0, 16), (1, 16), (4, 16), (4, 64)):
            base, lora = measure(device, dtype, tokens, adapters, rank, args.repeat)
            print(f"{tokens:>6} {adapters:>8} {rank:>4} {base:>9.3f} {lora:>9.3f} "
                  f"{(lora / base - 1) * 100:>7.0f}%")


if __name__ == "__main__":
    main()

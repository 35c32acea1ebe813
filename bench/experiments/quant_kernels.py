"""GPTQ/AWQ kernel timing: one group-quantized linear (4-bit, or 8 with --bits 8; groups of 128)
through each kernel pytgi has for it, against the float matmul it replaces, at batch 1 (decode,
memory-bound) and 64.

Kernels (shard/quantization/int_kernel_choice.py): `int4pack` (PyTorch's int4 packed matmul,
computing in bfloat16 as served; on CPU also `int4pack-fp32`, the op's exact float32 path),
`int8pack` (8 bits on CPU: PyTorch's int8 weight-only matmul once per group),
`dequant` (the packed weight dequantized whole per call, then F.linear), `triton` (own
dequantize-GEMM; CUDA only), and `float` (F.linear on the dequantized weight, what a float
checkpoint costs). Shapes: the projections of a ~20M-parameter Llama (hidden 512) and of an 8B
one (4096 x 4096, 4096 -> 14336). Each time is the fastest of `--samples` means of `--reps`
calls (the minimum: the machine may be shared); the table also gives the weight's bytes
(scales and zeros included).

    python -m pytgi_bench.experiments.quant_kernels [--device cpu|cuda] [--dtype float32|bfloat16|float16]
        [--bits 4|8] [--threads N] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial

import torch
import torch.nn.functional as F

from pytgi_shard.quantization.group_quantized import GroupQuantized
from pytgi_shard.quantization.int4pack_layout import int4pack_layout
from pytgi_shard.quantization.int4pack_weight import Int4PackWeight
from pytgi_shard.quantization.int_kernel_choice import IntKernel, build_int_weight
from pytgi_shard.quantization.int_packing import pack_int32

SHAPES = [(512, 1536), (1536, 512), (4096, 4096), (4096, 14336)]
BATCHES = [1, 64]
GROUP = 128


@dataclass(slots=True)
class Row:
    in_features: int
    out_features: int
    batch: int
    kernel: str
    ms: float
    weight_mib: float


def random_weight(
    k: int, n: int, bits: int, dtype: torch.dtype, device: torch.device
) -> GroupQuantized:
    g = torch.Generator().manual_seed(k * n)
    groups, top = k // GROUP, 1 << bits
    return GroupQuantized(
        qweight=pack_int32(torch.randint(0, top, (k, n), generator=g), bits, dim=0).to(device),
        zeros=torch.randint(0, top, (groups, n), generator=g, dtype=torch.int32).to(device),
        scales=(torch.rand(groups, n, generator=g) * 0.01).half().to(device),
        g_idx=(torch.arange(k, dtype=torch.int32) // GROUP).to(device),
        bits=bits,
        dtype=dtype,
    )


def time_ms(fn: Callable[[], object], device: torch.device, reps: int, samples: int) -> float:
    """The fastest of `samples` means of `reps` calls: on a shared machine the minimum is the
    estimate least disturbed by other processes."""
    for _ in range(2):
        fn()  # compile, allocate
    means = []
    for _ in range(samples):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        means.append((time.perf_counter() - start) / reps * 1e3)
    return min(means)


def kernels_for(device: torch.device, bits: int) -> list[IntKernel]:
    if device.type == "cuda":
        return [IntKernel.INT4PACK, IntKernel.TRITON, IntKernel.DEQUANT]
    op = IntKernel.INT4PACK if bits == 4 else IntKernel.INT8PACK
    return [op, IntKernel.DEQUANT]


class FloatLinear(torch.nn.Module):
    """What a float checkpoint's layer costs: F.linear on the dequantized weight."""

    weight: torch.Tensor

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def candidates(quantized: GroupQuantized, device: torch.device,
               dtype: torch.dtype) -> dict[str, torch.nn.Module]:  # fmt: skip
    """Every kernel that takes the weight on `device`, and the float matmul it replaces. On CPU
    also int4pack computing in float32 (exact), to show why it computes in bfloat16."""
    built: dict[str, torch.nn.Module] = {"float": FloatLinear(quantized.dequantize())}
    for kernel in kernels_for(device, quantized.bits):
        try:
            built[kernel.value] = build_int_weight(quantized, device, dtype, kernel)
        except ValueError:
            continue  # int4pack does not take this dtype on this device
    if device.type == "cpu" and quantized.bits == 4:
        layout = int4pack_layout(quantized.g_idx)
        built["int4pack-fp32"] = Int4PackWeight(quantized, layout, torch.float32)
    return built


def nbytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.buffers())


def measure(
    device: torch.device, dtype: torch.dtype, bits: int, reps: int, samples: int
) -> list[Row]:
    rows = []
    for k, n in SHAPES:
        built = candidates(random_weight(k, n, bits, dtype, device), device, dtype)
        for batch in BATCHES:
            x = torch.randn(batch, k, device=device, dtype=dtype)
            for name, module in built.items():
                # The slow CPU paths: fewer calls, or the table takes an hour.
                slow = device.type == "cpu" and name in ("dequant", "int4pack-fp32")
                ms = time_ms(partial(module, x), device, 1 if slow else reps, samples)
                mib = nbytes(module) / 2**20
                rows.append(Row(k, n, batch, name, ms, mib))
                print(
                    f"{k:>5} {n:>6} {batch:>5} {name:>13} {ms:9.3f} ms {mib:8.2f} MiB", flush=True
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--bits", type=int, default=4, choices=[4, 8])
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    print(f"device {device} dtype {dtype} bits {args.bits} threads {torch.get_num_threads()}")
    print("   in    out batch        kernel        time       weight")
    rows = measure(device, dtype, args.bits, args.reps, args.samples)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(device), "dtype": args.dtype, "bits": args.bits,
                       "rows": [asdict(r) for r in rows]}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()

"""The candidate kernels of the quantize-on-load modes, timed on one decoder layer's linears: the
measurements behind the kernel each QuantizedWeight class picks (README "Quantization").

For a Llama shape, one layer's projections (fused q|k|v, o, fused gate|up, down) are quantized
by each candidate and timed at each token count (1: a decode step of one request; 64: of a
batch of 64). Candidates are timed in rotation, `rounds` times, each round the median of
`reps` calls, and the fastest round is kept: other work on a shared machine only ever slows a
round down. Part of `python -m pytgi_bench.experiments.quantization` (its --kernels-only runs just this).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pytgi_bench.compare.model_builder import LlamaShape
from pytgi_shard.quantization.errors import QuantizationError
from pytgi_shard.quantization.int8_weight_only import Int8Kernel, Int8WeightOnly
from pytgi_shard.quantization.linear_weight import QuantizedWeight

Linear = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class KernelTime:
    candidate: str
    tokens: int
    # One layer's four projections, best round (microseconds).
    us: float
    # float32/float16 F.linear's time over this candidate's (> 1: faster than float).
    speedup: float


def layer_shapes(shape: LlamaShape) -> list[tuple[int, int]]:
    """[out, in] of one decoder layer's projections as pytgi fuses them."""
    head_dim = shape.hidden_size // shape.num_attention_heads
    qkv = (shape.num_attention_heads + 2 * shape.num_key_value_heads) * head_dim
    return [
        (qkv, shape.hidden_size),
        (shape.hidden_size, shape.num_attention_heads * head_dim),
        (2 * shape.intermediate_size, shape.hidden_size),
        (shape.hidden_size, shape.intermediate_size),
    ]


def _int8(kernel: Int8Kernel) -> Callable[[torch.Tensor], QuantizedWeight]:
    return lambda w: Int8WeightOnly.from_float(w, kernel)


def candidates(device: torch.device) -> dict[str, Callable[[torch.Tensor], Linear]]:
    """name -> how a float weight becomes a callable x -> x @ W^T."""
    from pytgi_shard.quantization.fp8_weight import Fp8Weight

    table: dict[str, Callable[[torch.Tensor], Linear]] = {
        "float": lambda w: lambda x: F.linear(x, w),
        "eetq int_mm (W8A8)": _int8(Int8Kernel.INT_MM),
        "eetq int8pack (W8A16)": _int8(Int8Kernel.INT8PACK),
        "eetq dequant (W8A16)": _int8(Int8Kernel.DEQUANT),
        "fp8 (as the device runs it)": Fp8Weight.from_float,
    }
    table.update(_bitsandbytes_candidates(device))
    return table


def _bitsandbytes_candidates(device: torch.device) -> dict[str, Callable[[torch.Tensor], Linear]]:
    """bnb's modes as pytgi runs them; 4-bit in both of bnb's layouts where the CPU has the
    fused kernel of the second (bitsandbytes_weight.Bnb4bitWeight)."""
    try:
        from pytgi_shard.quantization.bitsandbytes_weight import (
            BnbInt8Weight,
            BnbNf4Weight,
            import_bitsandbytes,
        )

        bnb = import_bitsandbytes()
    except QuantizationError:  # bitsandbytes is not installed here (e.g. the GPU machine)
        return {}
    table: dict[str, Callable[[torch.Tensor], Linear]] = {
        "bnb int8 (LLM.int8)": BnbInt8Weight.from_float,
        "bnb nf4 standard layout (gemm_4bit)": lambda w: BnbNf4Weight.from_float(w, False),
    }
    if device.type == "cpu" and bnb.functional.has_avx512bf16():
        table["bnb nf4 CPU layout (gemv_4bit, bf16)"] = lambda w: BnbNf4Weight.from_float(w, True)
    return table


def _time_layer(
    layer: list[tuple[Linear, int]], x_by_in: dict[int, torch.Tensor], reps: int,
    device: torch.device,
) -> float:  # fmt: skip
    """Median microseconds of one pass over the layer's projections."""
    calls = []
    for _ in range(reps):
        start = time.perf_counter()
        for fn, in_features in layer:
            fn(x_by_in[in_features])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        calls.append(time.perf_counter() - start)
    return statistics.median(calls) * 1e6


def measure_kernels(
    shape: LlamaShape, device: torch.device, dtype: torch.dtype, tokens: list[int],
    rounds: int = 5, reps: int = 20, seed: int = 0,
) -> list[KernelTime]:  # fmt: skip
    """Every candidate at every token count; see the module docstring."""
    g = torch.Generator().manual_seed(seed)
    shapes = layer_shapes(shape)
    weights = [(torch.randn(o, i, generator=g) * 0.02).to(device, dtype) for o, i in shapes]
    built: dict[str, list[tuple[Linear, int]]] = {}
    for name, make in candidates(device).items():
        try:
            built[name] = [(make(w), w.shape[1]) for w in weights]
        except (RuntimeError, ValueError, NotImplementedError) as error:
            print(f"kernel {name!r} left out on {device.type} {dtype}: {error}", file=sys.stderr)
    best: dict[tuple[str, int], float] = {}
    with torch.inference_mode():
        for n in tokens:
            xs = {i: torch.randn(n, i, generator=g).to(device, dtype) for _, i in shapes}
            for name, layer in list(built.items()):
                try:
                    _time_layer(layer, xs, 2, device)  # first-call costs, untimed
                except (RuntimeError, ValueError, NotImplementedError) as error:
                    # A kernel this device or dtype lacks is left out of the table, said so.
                    print(f"kernel {name!r} left out on {device.type} {dtype}: {error}",
                          file=sys.stderr)  # fmt: skip
                    del built[name]
            for _ in range(rounds):
                for name, layer in built.items():
                    us = _time_layer(layer, xs, reps, device)
                    best[(name, n)] = min(best.get((name, n), float("inf")), us)
    return [
        KernelTime(name, n, round(us, 1), round(best[("float", n)] / us, 3))
        for (name, n), us in best.items()
    ]

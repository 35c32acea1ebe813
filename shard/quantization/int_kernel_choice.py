"""Which kernel multiplies by a GPTQ/AWQ weight, from the device, the activations' dtype and the
weight's shape and grouping; `--quantize marlin` (the same GPTQ checkpoints) goes through the same
choice, Marlin's own CUDA kernel not being bundled.

- int4pack: PyTorch's int4 packed matmul (int4pack_weight), computing in bfloat16. Taken for 4
  bits with equal groups of 32-256 inputs once sorted (every unsharded or column-sharded weight,
  act-order or not; a row shard of an act-order weight may hit groups unevenly): on CPU for any
  model dtype with out_features % 16 == 0 (3x faster than the float32 matmul at batch 1, 1.4x
  slower at batch 64), on CUDA for bfloat16 models with out_features % 8 == 0. Maintained by
  PyTorch, reads 4 bits a weight.
- triton: own dequantize-GEMM (triton_dequant_gemm) on CUDA for everything else (8 bits,
  float16/float32 activations, uneven act-order groups).
- dequant: the packed weight dequantized whole each call (packed_int_weight). CPU fallback for
  what int4pack does not take (8 bits, uneven act-order row shards); about 10x slower than the
  float matmul, but it keeps the weight at 4/8 bits.

The measurements behind the order are in bench/quant_kernels.py and the README.
"""

from __future__ import annotations

from enum import Enum

import torch

from pytgi_shard.quantization.group_quantized import ContiguousGroups, GroupQuantized
from pytgi_shard.quantization.int4pack_weight import Int4PackWeight, int4pack_fits
from pytgi_shard.quantization.linear_weight import QuantizedWeight
from pytgi_shard.quantization.packed_int_weight import PackedIntWeight


class IntKernel(str, Enum):
    INT4PACK = "int4pack"
    TRITON = "triton"
    DEQUANT = "dequant"


def choose_int_kernel(
    device: torch.device, dtype: torch.dtype, bits: int, in_features: int, out_features: int,
    groups: ContiguousGroups | None,
) -> IntKernel:  # fmt: skip
    """The kernel for one layer (the order and the reasons: this module's docstring)."""
    if int4pack_fits(device, dtype, in_features, out_features, groups, bits):
        return IntKernel.INT4PACK
    if device.type == "cuda":
        return IntKernel.TRITON
    return IntKernel.DEQUANT


def build_int_weight(
    weight: GroupQuantized, device: torch.device, dtype: torch.dtype,
    kernel: IntKernel | None = None,
) -> QuantizedWeight:  # fmt: skip
    """The layer's QuantizedWeight through `kernel`, or the chosen one when None."""
    groups = weight.contiguous_groups()
    if kernel is None:
        kernel = choose_int_kernel(
            device, dtype, weight.bits, weight.in_features, weight.out_features, groups
        )
    if kernel is IntKernel.INT4PACK:
        if groups is None or not int4pack_fits(
            device, dtype, weight.in_features, weight.out_features, groups, weight.bits
        ):
            raise ValueError(
                f"int4pack does not take this {weight.bits}-bit [{weight.out_features}, "
                f"{weight.in_features}] weight on {device.type} in {dtype}"
            )
        return Int4PackWeight(weight, groups)
    if kernel is IntKernel.TRITON:
        # Imported here: Triton is only needed where its kernel is chosen.
        from pytgi_shard.quantization.triton_dequant_gemm import TritonIntWeight

        return TritonIntWeight(weight)
    return PackedIntWeight(weight)

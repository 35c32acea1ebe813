"""Which kernel multiplies by a GPTQ/AWQ weight, from the device, the activations' dtype and the
weight's shape and grouping; `--quantize marlin` (the same GPTQ checkpoints) goes through the same
choice, Marlin's own CUDA kernel not being bundled.

- int4pack: PyTorch's int4 packed matmul (int4pack_weight), computing in bfloat16, inputs
  ordered (act-order) and, where groups are uneven, padded by int4pack_layout. Taken for 4 bits:
  on CPU for any model dtype and grouping with out_features % 16 == 0 (3x faster than the
  float32 matmul at batch 1, about as fast at batch 64); on CUDA for bfloat16 models, unpadded
  groups and out_features % 8 == 0. Maintained by PyTorch, reads 4 bits a weight.
- int8pack: PyTorch's int8 weight-only matmul once per group (int8pack_groups_weight), in
  bfloat16. Taken for 8 bits on CPU with groups of equal size (4096 x 4096 in groups of 128,
  one thread: 1.7 ms at batch 1 against 2.5 ms for float32, 50 against 19 ms at batch 64).
- triton: own dequantize-GEMM (triton_dequant_gemm) on CUDA for everything else (8 bits,
  float16/float32 activations, uneven act-order groups read in place through g_idx).
- dequant: the packed weight dequantized whole each call (packed_int_weight). The CPU fallback
  for what the two ops do not take (8-bit act-order row shards, 4-bit weights with out_features
  not a multiple of 16); 100x slower than the float matmul on big layers (336 ms at 4096 x
  4096), but it keeps the weight at 4/8 bits.

The measurements behind the order are in bench/experiments/quant_kernels.py and the README.
"""

from __future__ import annotations

from enum import Enum

import torch

from pytgi_shard.device.capabilities import DeviceCapabilities, probe_capabilities
from pytgi_shard.quantization.group_quantized import GroupQuantized
from pytgi_shard.quantization.int4pack_layout import Int4PackLayout, int4pack_layout
from pytgi_shard.quantization.int4pack_weight import Int4PackWeight, int4pack_fits
from pytgi_shard.quantization.int8pack_groups_weight import Int8PackGroupsWeight, even_groups
from pytgi_shard.quantization.linear_weight import QuantizedWeight
from pytgi_shard.quantization.packed_int_weight import PackedIntWeight


class IntKernel(str, Enum):
    INT4PACK = "int4pack"
    INT8PACK = "int8pack"
    TRITON = "triton"
    DEQUANT = "dequant"


def choose_int_kernel(
    device: torch.device, dtype: torch.dtype, bits: int, out_features: int,
    layout: Int4PackLayout, even: bool, caps: DeviceCapabilities | None = None,
) -> IntKernel:  # fmt: skip
    """The kernel for one layer (the order and the reasons: this module's docstring); `layout`
    is how int4pack would read its input groups, `even` whether they hold as many inputs.
    `caps` (None: probed from `device`) says whether the Triton dequantize-GEMM may run; where
    it may not on CUDA (--disable-custom-kernels) the weight is dequantized instead."""
    caps = caps if caps is not None else probe_capabilities(device)
    if int4pack_fits(device, dtype, out_features, layout, bits):
        return IntKernel.INT4PACK
    if caps.triton_dequant_gemm:
        return IntKernel.TRITON
    if caps.kind == "cuda":
        # int8pack is PyTorch's CPU op.
        return IntKernel.DEQUANT
    if bits == 8 and even:
        return IntKernel.INT8PACK
    return IntKernel.DEQUANT


def build_int_weight(
    weight: GroupQuantized, device: torch.device, dtype: torch.dtype,
    kernel: IntKernel | None = None, caps: DeviceCapabilities | None = None,
) -> QuantizedWeight:  # fmt: skip
    """The layer's QuantizedWeight through `kernel`, or the one chosen under `caps` when None."""
    layout = int4pack_layout(weight.g_idx)
    if kernel is None:
        even = even_groups(weight.g_idx) is not None
        kernel = choose_int_kernel(
            device, dtype, weight.bits, weight.out_features, layout, even, caps
        )
    if kernel is IntKernel.INT4PACK:
        if not int4pack_fits(device, dtype, weight.out_features, layout, weight.bits):
            raise ValueError(
                f"int4pack does not take this {weight.bits}-bit [{weight.out_features}, "
                f"{weight.in_features}] weight on {device.type} in {dtype}"
            )
        return Int4PackWeight(weight, layout)
    if kernel is IntKernel.INT8PACK:
        return Int8PackGroupsWeight(weight)
    if kernel is IntKernel.TRITON:
        # Imported here: Triton is only needed where its kernel is chosen.
        from pytgi_shard.quantization.triton_dequant_gemm import TritonIntWeight

        return TritonIntWeight(weight)
    return PackedIntWeight(weight)

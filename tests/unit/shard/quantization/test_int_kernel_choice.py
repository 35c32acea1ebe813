"""Which kernel a GPTQ/AWQ layer gets (int_kernel_choice's documented rules), and how int4pack
reads any grouping (int4pack_layout): sorted, permuted (act-order), larger than its own groups
(GPTQ's group_size -1) or uneven (an act-order row shard), each exactly in float32."""

from __future__ import annotations

import pytest
import torch

from pytgi_shard.quantization.group_quantized import GroupQuantized
from pytgi_shard.quantization.int4pack_layout import Int4PackLayout, int4pack_layout
from pytgi_shard.quantization.int4pack_weight import Int4PackWeight
from pytgi_shard.quantization.int_kernel_choice import (
    IntKernel,
    build_int_weight,
    choose_int_kernel,
)
from pytgi_shard.quantization.int_packing import pack_int32
from tests.int_quantized_checkpoints import IntLayer, random_layer

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
SORTED = int4pack_layout(torch.arange(4096) // 128)
PERMUTED = int4pack_layout((torch.arange(4096) // 128)[torch.randperm(4096)])
UNEVEN = int4pack_layout((torch.arange(4096) // 128)[torch.randperm(4096)][:2048])

CHOICES = [
    # device, dtype, bits, out, int4pack layout, equal groups -> kernel
    (CPU, torch.float32, 4, 4096, SORTED, True, IntKernel.INT4PACK),
    (CPU, torch.bfloat16, 4, 4096, PERMUTED, True, IntKernel.INT4PACK),
    (CPU, torch.float32, 4, 4096, UNEVEN, False, IntKernel.INT4PACK),  # padded
    (CPU, torch.float32, 8, 4096, SORTED, True, IntKernel.INT8PACK),
    (CPU, torch.float32, 8, 4096, UNEVEN, False, IntKernel.DEQUANT),
    (CPU, torch.float32, 4, 4104, SORTED, True, IntKernel.DEQUANT),  # outputs not a multiple of 16
    (CUDA, torch.bfloat16, 4, 4104, PERMUTED, True, IntKernel.INT4PACK),
    (CUDA, torch.float16, 4, 4096, SORTED, True, IntKernel.TRITON),  # the op takes bf16 only
    (CUDA, torch.bfloat16, 8, 4096, SORTED, True, IntKernel.TRITON),
    (CUDA, torch.bfloat16, 4, 4096, UNEVEN, False, IntKernel.TRITON),  # g_idx in place
]


@pytest.mark.parametrize(("device", "dtype", "bits", "n", "layout", "even", "kernel"), CHOICES)
def test_the_documented_choice(
    device: torch.device, dtype: torch.dtype, bits: int, n: int, layout: Int4PackLayout,
    even: bool, kernel: IntKernel,
) -> None:  # fmt: skip
    assert choose_int_kernel(device, dtype, bits, n, layout, even) is kernel


def grouped(layer: IntLayer) -> GroupQuantized:
    return GroupQuantized(
        qweight=pack_int32(layer.q, layer.bits, dim=0), zeros=layer.zeros.int(),
        scales=layer.scales, g_idx=layer.g_idx, bits=layer.bits, dtype=torch.float32,
    )  # fmt: skip


def test_layouts_of_each_grouping() -> None:
    assert SORTED.perm is None and SORTED.group_size == 128 and not SORTED.padded
    assert PERMUTED.perm is not None and not PERMUTED.padded
    assert torch.equal(PERMUTED.groups, torch.arange(32).repeat_interleave(1))
    whole = int4pack_layout(torch.zeros(1024, dtype=torch.int32))  # group_size -1
    assert whole.group_size == 256 and torch.equal(whole.groups, torch.zeros(4, dtype=torch.long))
    # 2048 of 4096 act-order inputs: every group's share padded to whole runs of 32.
    assert UNEVEN.padded and UNEVEN.group_size == 32 and UNEVEN.perm is not None
    real = UNEVEN.perm[UNEVEN.perm < 2048]
    assert torch.equal(real.sort().values, torch.arange(2048))
    assert UNEVEN.perm.numel() == 32 * UNEVEN.groups.numel()


@pytest.mark.parametrize(
    ("in_features", "group_size", "act_order", "rows"),
    [(512, 512, False, 512), (256, 32, True, 256), (256, 32, True, 96), (200, 64, False, 200)],
)
def test_int4pack_reads_every_grouping_exactly_in_float32(
    in_features: int, group_size: int, act_order: bool, rows: int
) -> None:
    """A group of all inputs, act-order, an act-order row shard (the first `rows` inputs) and
    a ragged last group: exact through the op's float32 path, close in bfloat16."""
    full = random_layer(in_features, 16, 4, group_size, act_order, False, in_features + rows)
    layer = IntLayer(full.q[:rows], full.zeros, full.scales, full.g_idx[:rows], 4)
    quantized = grouped(layer)
    layout = int4pack_layout(quantized.g_idx)
    exact = Int4PackWeight(quantized, layout, torch.float32)
    assert torch.equal(exact.dequantize(), layer.dequantized())
    x = torch.randn(3, rows, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(exact(x), x @ layer.dequantized().t(), rtol=1e-5, atol=1e-5)
    served = Int4PackWeight(quantized, layout)
    expected = x.bfloat16().float() @ layer.dequantized().t()
    torch.testing.assert_close(served(x), expected, rtol=1e-2, atol=1e-2)


def test_a_forced_kernel_that_does_not_fit_is_refused() -> None:
    with pytest.raises(ValueError, match="int4pack does not take this 8-bit"):
        build_int_weight(grouped(random_layer(64, 16, 8, 32, False, True, 0)), CPU,
                         torch.float32, IntKernel.INT4PACK)  # fmt: skip
    uneven = random_layer(64, 16, 8, 32, True, True, 0)
    shard = IntLayer(uneven.q[:24], uneven.zeros, uneven.scales, uneven.g_idx[:24], 8)
    with pytest.raises(ValueError, match="int8 groups take 8-bit weights whose groups are equal"):
        build_int_weight(grouped(shard), CPU, torch.float32, IntKernel.INT8PACK)

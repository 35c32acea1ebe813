"""Which kernel a GPTQ/AWQ layer gets (int_kernel_choice's documented rules), and int4pack's
reading of groups larger than its own (GPTQ's group_size -1: one group of every input)."""

from __future__ import annotations

import pytest
import torch

from pytgi_shard.quantization.group_quantized import ContiguousGroups, GroupQuantized
from pytgi_shard.quantization.int4pack_weight import Int4PackWeight
from pytgi_shard.quantization.int_kernel_choice import (
    IntKernel,
    build_int_weight,
    choose_int_kernel,
)
from pytgi_shard.quantization.int_packing import pack_int32
from tests.int_quantized_checkpoints import random_layer

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
EVEN = ContiguousGroups(128, None)
PERMUTED = ContiguousGroups(128, torch.arange(4096))

CHOICES = [
    # device, dtype, bits, in, out, groups -> kernel
    (CPU, torch.float32, 4, 4096, 4096, EVEN, IntKernel.INT4PACK),
    (CPU, torch.bfloat16, 4, 4096, 4096, PERMUTED, IntKernel.INT4PACK),  # act-order, permuted
    (CPU, torch.float32, 8, 4096, 4096, EVEN, IntKernel.DEQUANT),
    (CPU, torch.float32, 4, 4096, 4096, None, IntKernel.DEQUANT),  # uneven act-order row shard
    (CPU, torch.float32, 4, 4096, 4104, EVEN, IntKernel.DEQUANT),  # outputs not a multiple of 16
    (CPU, torch.float32, 4, 4096, 4096, ContiguousGroups(48, None), IntKernel.DEQUANT),
    (CPU, torch.float32, 4, 4096, 4096, ContiguousGroups(4096, None), IntKernel.INT4PACK),
    (CUDA, torch.bfloat16, 4, 4096, 4104, EVEN, IntKernel.INT4PACK),
    (CUDA, torch.float16, 4, 4096, 4096, EVEN, IntKernel.TRITON),  # the op takes bf16 only
    (CUDA, torch.bfloat16, 8, 4096, 4096, EVEN, IntKernel.TRITON),
    (CUDA, torch.bfloat16, 4, 4096, 4096, None, IntKernel.TRITON),
]


@pytest.mark.parametrize(("device", "dtype", "bits", "k", "n", "groups", "kernel"), CHOICES)
def test_the_documented_choice(
    device: torch.device, dtype: torch.dtype, bits: int, k: int, n: int,
    groups: ContiguousGroups | None, kernel: IntKernel,
) -> None:  # fmt: skip
    assert choose_int_kernel(device, dtype, bits, k, n, groups) is kernel


def test_one_group_of_every_input_is_read_as_groups_of_256() -> None:
    layer = random_layer(512, 16, 4, 512, False, False, 0)
    quantized = GroupQuantized(
        qweight=pack_int32(layer.q, 4, dim=0), zeros=layer.zeros.int(), scales=layer.scales,
        g_idx=layer.g_idx, bits=4, dtype=torch.float32,
    )  # fmt: skip
    groups = quantized.contiguous_groups()
    assert groups == ContiguousGroups(512, None)
    exact = Int4PackWeight(quantized, groups, torch.float32)
    assert exact.group_size == 256 and exact.scales_and_zeros.shape == (2, 16, 2)
    assert torch.equal(exact.dequantize(), layer.dequantized())


def test_a_forced_kernel_that_does_not_fit_is_refused() -> None:
    layer = random_layer(64, 16, 8, 32, False, True, 0)
    quantized = GroupQuantized(
        qweight=pack_int32(layer.q, 8, dim=0), zeros=layer.zeros.int(), scales=layer.scales,
        g_idx=layer.g_idx, bits=8, dtype=torch.float32,
    )  # fmt: skip
    with pytest.raises(ValueError, match="int4pack does not take this 8-bit"):
        build_int_weight(quantized, CPU, torch.float32, IntKernel.INT4PACK)

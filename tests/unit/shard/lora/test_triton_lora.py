"""The Triton LoRA kernel pair (shard/lora/triton_lora.py) against the row-by-row float32
reference, through LoraLinear: under Triton's interpreter on the CPU (tests/conftest.py sets
TRITON_INTERPRET=1 without a GPU), compiled on CUDA when a GPU is present (bench/gpu.sh's tests
stage), over decode- and prefill-sized row counts, 1 to 8 adapters, partial-rank, cleared and
empty slots, fused ranks above one tile."""

from __future__ import annotations

import pytest
import torch

from tests.unit.shard.lora.test_lora_paths import check, layer_with
from tests.unit.shard.triton_device import kernel_dtypes, triton_device

DEVICE, INTERPRETED = triton_device()
DTYPES = kernel_dtypes(INTERPRETED)
TOLERANCE = {torch.float32: 1e-4, torch.float16: 3e-2, torch.bfloat16: 6e-2}


@pytest.mark.parametrize(("tokens", "slots", "rank", "k", "n"), [
    (1, 2, 4, 32, 16),     # one decode row, one adapter
    (16, 9, 16, 48, 40),   # a decode tile of eight adapters and the base model
    (70, 5, 12, 64, 100),  # prefill-sized: several row tiles, uneven n
    (33, 4, 48, 40, 24),   # a fused rank above one tile's 16
])
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_kernel_pair_matches_the_reference(tokens: int, slots: int, rank: int, k: int,
                                                  n: int, dtype: torch.dtype) -> None:
    layer = layer_with(slots, rank, k, n, dtype, DEVICE, seed=tokens, path="triton")
    check(layer, tokens, slots, seed=tokens, tol=TOLERANCE[dtype])

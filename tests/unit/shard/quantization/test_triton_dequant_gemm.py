"""The Triton dequantize-GEMM against the plain-PyTorch dequantized weight: 4 and 8 bits, act-order
g_idx, ragged tiles (M, N and K not multiples of the blocks), K split over programs, float32 and
float16. On CPU it runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pytgi_shard.quantization.group_quantized import GroupQuantized  # noqa: E402
from pytgi_shard.quantization.int_packing import pack_int32  # noqa: E402
from pytgi_shard.quantization.triton_dequant_gemm import (  # noqa: E402
    TritonIntWeight,
    dequant_gemm,
    gemm_config,
)
from tests.int_quantized_checkpoints import random_layer  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# The interpreter computes through numpy, which has no bfloat16.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def weight(in_features: int, out_features: int, bits: int, act_order: bool,
           dtype: torch.dtype) -> TritonIntWeight:  # fmt: skip
    layer = random_layer(in_features, out_features, bits, 40, act_order, False, bits)
    quantized = GroupQuantized(
        qweight=pack_int32(layer.q, bits, dim=0), zeros=layer.zeros.int(),
        scales=layer.scales, g_idx=layer.g_idx, bits=bits, dtype=dtype,
    )  # fmt: skip
    return TritonIntWeight(quantized).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("bits", "act_order"), [(4, False), (4, True), (8, True)])
@pytest.mark.parametrize(("tokens", "split_k"), [(1, 1), (1, 3), (19, 2), (70, 1)])
def test_matches_the_dequantized_matmul(
    dtype: torch.dtype, bits: int, act_order: bool, tokens: int, split_k: int
) -> None:
    w = weight(200, 72, bits, act_order, dtype)  # K: 3 tiles + a ragged one; N: 1 + ragged
    x = torch.randn(tokens, 200, generator=torch.Generator().manual_seed(tokens)).to(DEVICE, dtype)
    dense = w.dequantize()
    expected = (x.float() @ dense.float().t()).to(dtype)
    got = dequant_gemm(x, w, split_k=split_k)
    assert got.dtype == dtype and got.shape == (tokens, 72)
    # Same weights exactly; float32 accumulation in another order, one rounding of the output.
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    scale = float(expected.float().abs().max())
    torch.testing.assert_close(got.float(), expected.float(), rtol=tol, atol=tol * scale)


def test_leading_dims_and_an_empty_batch() -> None:
    w = weight(64, 16, 4, False, torch.float32)
    x = torch.randn(2, 3, 64).to(DEVICE)
    torch.testing.assert_close(w(x), x @ w.dequantize().t(), rtol=1e-5, atol=1e-5)
    assert w(torch.empty(0, 64, device=DEVICE)).shape == (0, 16)


def test_small_batches_split_k_to_fill_the_device() -> None:
    cuda = torch.device("cuda")
    # Without a device to ask, one split; the rule itself from the SM count.
    assert gemm_config(1, 4096, 4096, torch.device("cpu")).split_k == 1
    if torch.cuda.is_available():
        sms = torch.cuda.get_device_properties(cuda).multi_processor_count
        decode = gemm_config(1, 4096, 4096, cuda)
        assert decode.split_k == min(16, -(-2 * sms // 64))
        assert gemm_config(512, 4096, 4096, cuda).split_k == 1
    assert gemm_config(1, 64, 100, torch.device("cpu"), split_k=8).split_k == 2  # 2 K tiles

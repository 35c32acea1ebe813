"""--quantize eetq (int8_weight_only.py) against its float reference: every weight within half a
step of its row's int8 grid, each kernel equal to its own arithmetic spelt out in float (weight
only: x @ dequantize().T; INT_MM: the per-token int8 activations times it), any leading shape of
x, a quarter of float32's bytes."""

from __future__ import annotations

import pytest
import torch

from pytgi_shard.quantization.int8_weight_only import (
    Int8Kernel,
    Int8WeightOnly,
    default_int8_kernel,
    quantize_rows,
    quantize_tokens,
)


def weight(out_features: int = 96, in_features: int = 80, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) * 0.05
    w[3] *= 20  # rows of very different ranges: the scales are per row
    w[7] = 0  # an all-zero row must not divide by zero
    return w


def test_the_dequantized_weight_is_within_half_a_step_of_each_rows_grid() -> None:
    w = weight()
    q = Int8WeightOnly.from_float(w)
    step = w.abs().amax(dim=1, keepdim=True) / 127
    err = (q.dequantize() - w).abs()
    assert torch.all(err <= step / 2 * (1 + 1e-5) + 1e-12)
    assert torch.equal(q.dequantize()[7], torch.zeros(80))
    assert q.qweight.abs().amax(dim=1)[:7].eq(127).all()  # each row's extreme on the grid's end
    rel = (q.dequantize() - w).norm() / w.norm()
    assert rel < 0.01


@pytest.mark.parametrize("kernel", [Int8Kernel.DEQUANT, Int8Kernel.INT8PACK])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_only_kernels_multiply_by_the_dequantized_weight(
    kernel: Int8Kernel, dtype: torch.dtype
) -> None:
    w = weight().to(dtype)
    q = Int8WeightOnly.from_float(w, kernel)
    x = torch.randn(2, 5, 80, generator=torch.Generator().manual_seed(1)).to(dtype)
    y = q(x)
    assert y.shape == (2, 5, 96) and y.dtype == dtype
    ref = x.double() @ q.dequantize().double().T
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("shape", [(1, 80), (7, 80), (2, 3, 80)])
def test_int_mm_multiplies_the_per_token_int8_activations_by_the_dequantized_weight(
    shape: tuple[int, ...],
) -> None:
    w = weight()
    q = Int8WeightOnly.from_float(w, Int8Kernel.INT_MM)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    rows = x.view(-1, 80)
    if rows.shape[0] > 1:
        rows[-1] = 0  # a token of zeros (its scale must not divide by zero)
    y = q(x)
    assert y.shape == (*shape[:-1], 96)
    xq, xs = quantize_tokens(rows)
    rq, rs = quantize_rows(rows)  # the same rounding as the weights' (but for a zero row's scale)
    assert torch.equal(xq, rq) and torch.allclose(xs[:, 0][rs != 1], rs[rs != 1])
    ref = (xq.double() * xs.double()) @ q.dequantize().double().T
    assert torch.allclose(y.reshape(-1, 96).double(), ref, rtol=1e-5, atol=1e-6)
    if rows.shape[0] > 1:
        assert torch.equal(y.reshape(-1, 96)[-1], torch.zeros(96))  # stays zero
    # Against the float matmul: the two roundings of int8 (weights and activations) only.
    exact = rows.double() @ w.double().T
    assert (y.reshape(-1, 96).double() - exact).norm() / exact.norm() < 0.02


def test_the_int8_weight_takes_a_quarter_of_float32s_bytes() -> None:
    w = weight(256, 512)
    q = Int8WeightOnly.from_float(w)
    assert q.nbytes() == 256 * 512 + 4 * 256  # int8 values and a float32 scale per row
    assert w.numel() * 4 / q.nbytes() > 3.9
    assert w.bfloat16().numel() * 2 / Int8WeightOnly.from_float(w.bfloat16()).nbytes() > 1.95


def test_the_cpu_kernel_is_the_measured_one() -> None:
    expected = (
        Int8Kernel.INT_MM
        if torch.backends.cpu.get_cpu_capability() == "AVX512"
        else Int8Kernel.DEQUANT
    )
    assert default_int8_kernel(torch.device("cpu")) is expected
    assert Int8WeightOnly.from_float(weight()).kernel is expected

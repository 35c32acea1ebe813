"""--quantize bitsandbytes / bitsandbytes-nf4 / bitsandbytes-fp4 (bitsandbytes_weight.py) against
their float reference: the dequantized weights within each code's rounding, the 4-bit matmuls
equal to x @ dequantize().T in the activations' dtype, LLM.int8's equal to its decomposition
spelt out in float (outlier columns >= 6.0 in float, the rest per-token int8), and the bytes."""

from __future__ import annotations

import pytest
import torch

from pytgi_shard.quantization.bitsandbytes_weight import (
    BLOCKSIZE_4BIT,
    LLM_INT8_THRESHOLD,
    Bnb4bitWeight,
    BnbFp4Weight,
    BnbInt8Weight,
    BnbNf4Weight,
    cpu_layout_fits,
    import_bitsandbytes,
)


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Fixed activations: every bound below is checked on the same numbers each run."""
    torch.manual_seed(0)


HAS_AVX512BF16 = bool(import_bitsandbytes().functional.has_avx512bf16())
# bnb's standard layout, and its CPU inference layout where this CPU runs it.
LAYOUTS = [False, pytest.param(True, marks=pytest.mark.skipif(
    not HAS_AVX512BF16, reason="bnb's CPU layout needs AVX512-BF16"))]  # fmt: skip

# The published 4-bit codes (bitsandbytes' create_normal_map / FP4 table), sorted.
NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
       -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
       0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
       0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]  # fmt: skip
FP4_MAGNITUDES = [0.0, 0.0052083333, 0.1666666667, 0.25, 0.3333333333, 0.5, 0.6666666667, 1.0]


def weight(out_features: int = 64, in_features: int = 128, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) * 0.05
    w[2] *= 25
    return w


def half_largest_gap(code: list[float]) -> float:
    return max(b - a for a, b in zip(code, code[1:], strict=False)) / 2


FP4 = [-m for m in FP4_MAGNITUDES[::-1]] + FP4_MAGNITUDES


@pytest.mark.parametrize("cpu_packed", LAYOUTS)
@pytest.mark.parametrize(
    ("cls", "code", "max_rel"), [(BnbNf4Weight, NF4, 0.11), (BnbFp4Weight, FP4, 0.14)]
)
def test_4bit_weights_are_within_half_the_codes_largest_gap_of_each_blocks_range(
    cls: type[Bnb4bitWeight], code: list[float], max_rel: float, cpu_packed: bool
) -> None:
    w = weight()
    q = cls.from_float(w, cpu_packed)
    assert q.cpu_packed is cpu_packed
    assert sorted(q.code.tolist()) == pytest.approx(sorted(code), abs=1e-6)
    blocks = w.reshape(-1, BLOCKSIZE_4BIT)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    err = (q.dequantize().reshape(-1, BLOCKSIZE_4BIT) - blocks).abs()
    # The CPU layout keeps each absmax in bfloat16: 2^-9 of it more.
    slack = 2.0**-9 if cpu_packed else 0.0
    assert torch.all(err <= absmax * (half_largest_gap(code) + slack) * (1 + 1e-5))
    assert (q.dequantize() - w).norm() / w.norm() < max_rel


@pytest.mark.parametrize("cpu_packed", LAYOUTS)
@pytest.mark.parametrize("cls", [BnbNf4Weight, BnbFp4Weight])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_4bit_matmul_is_x_times_the_dequantized_weight(
    cls: type[Bnb4bitWeight], dtype: torch.dtype, cpu_packed: bool
) -> None:
    """In the activations' dtype; bnb's CPU-layout kernel computes in bfloat16 (its input
    rounded to bfloat16, its result cast back)."""
    q = cls.from_float(weight().to(dtype), cpu_packed)
    for shape in [(1, 128), (6, 128), (2, 3, 128)]:
        x = torch.randn(*shape).to(dtype)
        y = q(x)
        assert y.shape == (*shape[:-1], 64) and y.dtype == dtype
        computed = x.bfloat16() if cpu_packed else x
        ref = computed.double() @ q.dequantize().double().T
        tol = 1e-5 if dtype == torch.float32 and not cpu_packed else 2e-2
        assert torch.allclose(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_the_cpu_layout_is_taken_where_it_fits() -> None:
    # Truthiness: on a CPU without AVX512-BF16 bnb's probe answers the int 0, and so does the
    # layout choice (this failed `is False` on such a machine).
    assert bool(BnbNf4Weight.from_float(weight()).cpu_packed) is HAS_AVX512BF16
    assert not cpu_layout_fits(weight(48, 128), True)  # outputs not in tiles of 32
    assert not cpu_layout_fits(weight(64, 96), True)  # inputs not in blocks of 64
    assert not cpu_layout_fits(weight(), False)


def test_llm_int8_weight_is_within_half_a_step_of_each_rows_grid() -> None:
    w = weight()
    q = BnbInt8Weight.from_float(w)
    step = w.abs().amax(dim=1, keepdim=True) / 127
    # Quantized from float16 as bitsandbytes does: its rounding (2^-11 relative) comes on top.
    assert torch.all((q.dequantize() - w).abs() <= step / 2 * (1 + 1e-3) + w.abs() * 2.0**-11)
    assert (q.dequantize() - w).norm() / w.norm() < 0.01


def llm_int8_reference(x: torch.Tensor, w: torch.Tensor, threshold: float) -> torch.Tensor:
    """LLM.int8 in float64: columns holding a value >= threshold multiplied in float, the rest of
    each token quantized to int8 by the absmax of its values below the threshold."""
    x = x.double()
    outliers = x.abs() >= threshold
    cols = outliers.any(dim=0)
    inliers = x.masked_fill(outliers, 0)
    scale = inliers.abs().amax(dim=1, keepdim=True) / 127
    xq = torch.round(inliers / scale).masked_fill(cols[None, :], 0)
    return (xq * scale) @ w.double().T + x[:, cols] @ w.double()[:, cols].T


@pytest.mark.parametrize("shape", [(5, 128), (2, 3, 128)])
def test_llm_int8_keeps_outlier_columns_in_float_and_the_rest_int8(shape: tuple[int, ...]) -> None:
    q = BnbInt8Weight.from_float(weight())
    x = torch.randn(*shape)
    rows = x.view(-1, 128)
    rows[1, 17] = 9.0  # an outlier: column 17 goes through the float path for every token
    rows[2, 40] = -LLM_INT8_THRESHOLD
    before = x.clone()
    y = q(x)
    assert torch.equal(x, before)  # the caller's activations are not touched
    assert y.shape == (*shape[:-1], 64)
    ref = llm_int8_reference(rows, q.dequantize(), LLM_INT8_THRESHOLD)
    # float32 scaling (bnb multiplies by 1/127² as 6.200124e-05) against float64: 1e-4.
    assert torch.allclose(y.view(-1, 64).double(), ref, rtol=1e-4, atol=1e-4)
    # Without the decomposition the outlier would set token 1's int8 step: its error is larger.
    exact = rows.double() @ weight().double().T
    plain = llm_int8_reference(rows, q.dequantize(), float("inf"))
    assert (y.view(-1, 64)[1].double() - exact[1]).norm() < (plain[1] - exact[1]).norm()


def test_bytes_against_float32() -> None:
    w = weight(256, 512)
    int8 = BnbInt8Weight.from_float(w)
    assert int8.nbytes() == 256 * 512 + 4 * 256
    for cls in (BnbNf4Weight, BnbFp4Weight):
        q = cls.from_float(w, cpu_packed=False)
        # Two values a byte, a float32 absmax per 64, the 16-entry float32 code.
        assert q.nbytes() == 256 * 512 // 2 + 4 * 256 * 512 // BLOCKSIZE_4BIT + 16 * 4
        assert w.numel() * 4 / q.nbytes() > 7.0
        if HAS_AVX512BF16:  # the CPU layout's absmax is bfloat16
            packed = cls.from_float(w, cpu_packed=True)
            assert packed.nbytes() == 256 * 512 // 2 + 2 * 256 * 512 // BLOCKSIZE_4BIT + 16 * 4

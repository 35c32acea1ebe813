"""--quantize fp8 and FP8 checkpoints' weights (fp8_weight.py) against their float reference:
every weight within float8_e4m3fn's rounding of its row's scaled value, the matmul equal to
x @ dequantize().T, per-tensor and per-row scales in every stored shape, half of bfloat16's
bytes. The _scaled_mm path needs an FP8 GPU: tests/gpu/test_quantized_weights_cuda.py."""

from __future__ import annotations

import pytest
import torch

from pytgi_shard.quantization.fp8_weight import FP8_DTYPE, Fp8Weight, quantize_fp8_rows


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Fixed activations: every bound below is checked on the same numbers each run."""
    torch.manual_seed(0)


# e4m3: 3 mantissa bits (half an ulp is 2^-4 of the value), subnormals in steps of 2^-9.
HALF_ULP = 2.0**-4
HALF_SUBNORMAL_STEP = 2.0**-10


def weight(out_features: int = 64, in_features: int = 48, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) * 0.05
    w[5] *= 30
    w[9] = 0
    return w


def test_the_dequantized_weight_is_within_e4m3_rounding_of_each_value() -> None:
    w = weight()
    q = Fp8Weight.from_float(w)
    assert q.qweight.dtype == FP8_DTYPE and q.scale.shape == (64,)
    scale = w.abs().amax(dim=1, keepdim=True) / 448
    bound = torch.maximum(w.abs() * HALF_ULP, scale * HALF_SUBNORMAL_STEP)
    assert torch.all((q.dequantize() - w).abs() <= bound * (1 + 1e-5) + 1e-12)
    assert torch.equal(q.dequantize()[9], torch.zeros(48))
    assert (q.dequantize() - w).norm() / w.norm() < 0.04


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_matmul_is_x_times_the_dequantized_weight(dtype: torch.dtype) -> None:
    q = Fp8Weight.from_float(weight().to(dtype))
    x = torch.randn(3, 4, 48).to(dtype)
    y = q(x)
    assert y.shape == (3, 4, 64) and y.dtype == dtype
    ref = x.double() @ q.dequantize().double().T
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("scale_shape", [(), (1,), (64,), (64, 1)])
def test_a_stored_weight_and_scale_in_any_checkpoint_shape(scale_shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(1)
    stored = (torch.randn(64, 48, generator=g) * 100).clamp(-448, 448).to(FP8_DTYPE)
    numel = 1 if scale_shape in ((), (1,)) else 64
    scale = (torch.rand(numel, generator=g) + 0.5).reshape(scale_shape)
    q = Fp8Weight(stored, scale, torch.tensor([0.02]))
    rows = scale.reshape(-1, 1) if numel > 1 else scale.reshape(())
    expected = stored.float() * rows
    assert torch.equal(q.dequantize(), expected)  # float32, exact
    assert q.input_scale is not None and q.input_scale.shape == ()
    x = torch.randn(5, 48)
    assert torch.allclose(q(x), x @ expected.T, rtol=1e-5, atol=1e-4)


def test_a_blockwise_scale_is_refused() -> None:
    stored = torch.zeros(64, 48).to(FP8_DTYPE)
    with pytest.raises(ValueError, match="per tensor"):
        Fp8Weight(stored, torch.ones(64, 3))


def test_fp8_takes_a_quarter_of_float32s_bytes_and_half_of_bfloat16s() -> None:
    w = weight(256, 512)
    q = Fp8Weight.from_float(w)
    assert q.nbytes() == 256 * 512 + 4 * 256
    assert w.numel() * 4 / q.nbytes() > 3.9
    assert w.numel() * 2 / Fp8Weight.from_float(w.bfloat16()).nbytes() > 1.95


def test_rows_quantize_to_the_full_e4m3_range() -> None:
    q, scale = quantize_fp8_rows(weight())
    top = q.float().abs().amax(dim=1)
    assert torch.equal(top[top > 0], torch.full_like(top[top > 0], 448.0))
    assert scale[9] == 1.0


@pytest.mark.parametrize("static", [False, True])
def test_the_scaled_mm_path_through_pytorchs_cpu_scaled_mm(static: bool) -> None:
    """The FP8-GPU path's arithmetic and torch._scaled_mm call, run by the op's CPU
    implementation: FP8 activations (per token, or the static scale) times the FP8 weight, both
    scales applied to the float32 result."""
    w = weight()
    input_scale = torch.tensor(0.004) if static else None
    q = Fp8Weight(*quantize_fp8_rows(w), input_scale)
    q.use_scaled_mm = True  # what a compute capability >= 8.9 GPU takes
    x = torch.randn(2, 3, 48)
    x[0, 0, 0] = 3.0  # beyond the static scale's range (448 * 0.004): saturates at 1.792
    rows = x.reshape(-1, 48)
    if static:
        xq = (rows / 0.004).clamp(-448, 448).to(FP8_DTYPE).double() * 0.004
    else:
        qx, sx = quantize_fp8_rows(rows)
        xq = qx.double() * sx.double()[:, None]
    ref = xq @ q.dequantize().double().T
    y = q(x)
    assert y.shape == (2, 3, 64)
    assert torch.allclose(y.reshape(-1, 64).double(), ref, rtol=1e-5, atol=1e-5)

"""The quantize-on-load weights' CUDA paths (skipped without a GPU; bench/gpu.sh runs tests/gpu/):
eetq's _int_mm with padded and unpadded token counts, FP8's torch._scaled_mm with dynamic
per-token and static activation scales (on compute capability >= 8.9), and bitsandbytes' CUDA
kernels, each against the same arithmetic spelt out in float64 on the GPU's own quantized values.
"""

from __future__ import annotations

import pytest
import torch

from pytgi_shard.quantization.fp8_weight import Fp8Weight, quantize_fp8_rows, scaled_mm_supported
from pytgi_shard.quantization.int8_weight_only import Int8Kernel, Int8WeightOnly, quantize_rows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

OUT, IN = 256, 512


def weight(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(OUT, IN, generator=g) * 0.05).to("cuda", dtype)


def close(y: torch.Tensor, ref: torch.Tensor, tol: float) -> bool:
    return bool(torch.allclose(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item()))


@pytest.mark.parametrize("tokens", [1, 16, 17, 64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_int_mm_on_cuda(tokens: int, dtype: torch.dtype) -> None:
    q = Int8WeightOnly.from_float(weight(dtype), Int8Kernel.INT_MM)
    x = torch.randn(tokens, IN, device="cuda", dtype=dtype)
    xq, xs = quantize_rows(x)
    ref = (xq.double() * xs.double()[:, None]) @ q.dequantize().double().T
    assert close(q(x), ref, 1e-2)
    # The fallback for shapes _int_mm does not take (the bench times _weight_int8pack_mm too).
    fallback = Int8WeightOnly(q.qweight, q.scale, dtype, Int8Kernel.DEQUANT)
    assert close(fallback(x), x.double() @ q.dequantize().double().T, 1e-2)


@pytest.mark.skipif(
    not torch.cuda.is_available() or not scaled_mm_supported(torch.device("cuda")),
    reason="needs FP8 tensor cores (compute capability >= 8.9)",
)
@pytest.mark.parametrize("tokens", [1, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_scaled_mm_on_fp8_gpus(tokens: int, dtype: torch.dtype) -> None:
    q = Fp8Weight.from_float(weight(dtype))
    assert q.use_scaled_mm
    x = torch.randn(2, tokens, IN, device="cuda", dtype=dtype)
    rows = x.reshape(-1, IN)
    xq, xs = quantize_fp8_rows(rows)
    ref = (xq.double() * xs.double()[:, None]) @ q.dequantize().double().T
    assert close(q(x).reshape(-1, OUT), ref, 1e-2)
    static = Fp8Weight(q.qweight, q.scale, torch.tensor(0.01), dtype)
    sq = (rows.float() / 0.01).clamp(-448, 448).to(torch.float8_e4m3fn)
    ref_static = (sq.double() * 0.01) @ q.dequantize().double().T
    assert close(static(x).reshape(-1, OUT), ref_static, 1e-2)


@pytest.mark.parametrize("tokens", [1, 64])
def test_bitsandbytes_on_cuda(tokens: int) -> None:
    pytest.importorskip("bitsandbytes")
    from pytgi_shard.quantization.bitsandbytes_weight import (
        BnbFp4Weight,
        BnbInt8Weight,
        BnbNf4Weight,
    )

    w = weight(torch.float16)
    x = torch.randn(tokens, IN, device="cuda", dtype=torch.float16)
    for cls in (BnbNf4Weight, BnbFp4Weight):
        q = cls.from_float(w)
        assert close(q(x), x.double() @ q.dequantize().double().T, 1e-2)
    int8 = BnbInt8Weight.from_float(w)
    exact = x.double() @ w.double().T
    assert (int8(x).double() - exact).norm() / exact.norm() < 0.02


def test_eetq_and_fp8_run_inside_a_cuda_graph() -> None:
    """pytgi captures its decode steps as CUDA graphs: no host sync in these forwards. (The
    bitsandbytes modes are not capturable, LLM.int8's outlier search syncs; TGI runs them
    without CUDA graphs.)"""
    w = weight(torch.bfloat16)
    layers = [Int8WeightOnly.from_float(w)]
    if scaled_mm_supported(torch.device("cuda")):
        layers.append(Fp8Weight.from_float(w))
    for layer in layers:
        x = torch.randn(4, IN, device="cuda", dtype=torch.bfloat16)
        eager = layer(x)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            layer(x)  # warm-up off the capture, as torch.cuda.graphs asks
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = layer(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager), type(layer).__name__

"""The FP8 KV cache (--kv-cache-dtype): the Triton kernels' byte codec against torch's FP8
conversion, the reference backend's quantized cache against the same attention over the
dequantized values, and the Triton kernels against the reference on FP8 caches.

On CPU the kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os

import pytest
import torch

from pytgi_shard.attention import AttentionMetadata, get_backend
from pytgi_shard.attention.kv_cache import KVCache
from pytgi_shard.attention.kv_quant import KVScales, dequantize, kv_cache_dtype, quantize

triton = pytest.importorskip("triton", reason="triton is not installed")
import triton.language as tl  # noqa: E402

from pytgi_shard.attention.triton_backend import TritonAttention  # noqa: E402
from pytgi_shard.attention.triton_fp8 import fp8_code, fp8_decode, fp8_encode  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu")
FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]


def codec_inputs(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of the format, the midpoints between neighbours (ties: to even), one
    float32 step either side of them, values past the range (saturate), and random spreads."""
    every = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    values = torch.sort(every[torch.isfinite(every)].unique()).values
    mids = (values[1:] + values[:-1]) / 2
    up = torch.nextafter(mids, torch.full_like(mids, float("inf")))
    down = torch.nextafter(mids, torch.full_like(mids, float("-inf")))
    gen = torch.Generator().manual_seed(0)
    spread = torch.randn(3000, generator=gen) * torch.logspace(-12, 6, 3000)
    extremes = torch.tensor([0.0, -0.0, 1e30, -1e30, 1e-30, -1e-42, 127.835, 60000.0, -465.0])
    return torch.cat([values, mids, up, down, spread, extremes])


@triton.jit
def _codec_kernel(x_ptr, bytes_ptr, out_ptr, n, FP8: tl.constexpr, BLOCK: tl.constexpr):
    """The kernels' encoding of x into bytes, and those bytes decoded into out."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    code = fp8_encode(tl.load(x_ptr + i, mask=mask, other=0.0).to(tl.float32), FP8)
    tl.store(bytes_ptr + i, code, mask=mask)
    tl.store(out_ptr + i, fp8_decode(code, FP8), mask=mask)


def roundtrip(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(the bytes the kernels store for float32 x as `dtype`, those bytes decoded)."""
    stored = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    decoded = torch.empty_like(x)
    block = 1024
    _codec_kernel[(triton.cdiv(x.numel(), block),)](
        x, stored, decoded, x.numel(), FP8=fp8_code(torch.empty(0, dtype=dtype)), BLOCK=block
    )
    return stored, decoded


@pytest.mark.parametrize("dtype", FORMATS)
def test_kernel_codec_is_torchs_conversion_bit_for_bit(dtype: torch.dtype) -> None:
    x = codec_inputs(dtype).to(DEVICE)
    stored, decoded = roundtrip(x, dtype)
    expected = quantize(x, torch.ones(1, device=DEVICE), dtype)
    assert torch.equal(stored, expected)
    assert torch.equal(decoded, expected.view(dtype).float())
    assert torch.isfinite(decoded).all()


def fp8_case(
    cached: list[int], new: list[int], dtype: torch.dtype, q_dtype: torch.dtype, seed: int,
    heads: int = 8, kv_heads: int = 2, head_dim: int = 16, block_size: int = 4,
) -> tuple[list[torch.Tensor], KVScales, AttentionMetadata]:
    """q, k, v of the new tokens and FP8 caches of random bytes (cached prefixes and garbage
    alike), with scales other than 1 so that a kernel that forgets one cannot pass."""
    gen = torch.Generator().manual_seed(seed)
    blocks = sum(-(-(c + n) // block_size) for c, n in zip(cached, new, strict=True)) + 1
    order = torch.randperm(blocks - 1, generator=gen) + 1
    tables, at = [], 0
    for c, n in zip(cached, new, strict=True):
        count = -(-(c + n) // block_size)
        tables.append(order[at:at + count].tolist())
        at += count
    total = sum(new)
    tensors = [
        (torch.randn(total, h, head_dim, generator=gen) * 3).to(q_dtype).to(DEVICE)
        for h in (heads, kv_heads, kv_heads)
    ]
    for _ in range(2):
        # Values of the size K/V have (cached prefixes and garbage alike), not random bytes:
        # e5m2's far range would overflow the half-precision products.
        values = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen) * 4
        tensors.append(values.to(dtype).to(DEVICE))
    meta = AttentionMetadata.build(new, cached, tables, block_size, DEVICE)
    return tensors, KVScales.of(0.5, 1.75, DEVICE), meta


def fresh(meta: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(
        meta.is_prefill, meta.cu_seqlens_q, meta.seqlens_k, meta.slot_mapping, meta.block_tables,
        meta.max_seqlen_q, meta.max_seqlen_k, meta.block_size,
    )


@pytest.mark.parametrize("dtype", FORMATS)
def test_reference_attends_over_the_dequantized_values(dtype: torch.dtype) -> None:
    """An FP8 cache reads back as float32 attention over quantize-then-dequantize of the same
    K/V: the only error FP8 adds is the rounding of what is stored."""
    (q, k, v, kc, vc), scales, meta = fp8_case([9, 0, 3], [1, 6, 4], dtype, torch.float32, 1)
    plain_kc, plain_vc = dequantize(kc, scales.key, torch.float32), dequantize(
        vc, scales.value, torch.float32)
    ref = get_backend("reference")
    out = ref.forward(q, k, v, kc, vc, fresh(meta), 0.25, kv_scales=scales)
    k8 = dequantize(quantize(k, scales.key, dtype).view(dtype), scales.key, torch.float32)
    v8 = dequantize(quantize(v, scales.value, dtype).view(dtype), scales.value, torch.float32)
    expected = ref.forward(q, k8, v8, plain_kc, plain_vc, fresh(meta), 0.25)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dequantize(kc, scales.key, torch.float32), plain_kc)


@pytest.mark.parametrize(
    ("dtype", "cached", "new", "window", "splits"),
    [(torch.float8_e4m3fn, [16, 5, 0], [1, 1, 1], None, 3),  # decode, split-K
     (torch.float8_e5m2, [16, 5, 0], [1, 1, 1], None, 1),
     # prefill: a prompt, a chunk after a cached prefix, a decode row (mixed)
     (torch.float8_e4m3fn, [0, 21, 7], [13, 6, 1], None, None),
     (torch.float8_e5m2, [11, 0], [5, 9], 6, None)],  # sliding window
)
def test_triton_matches_the_reference_on_fp8_caches(
    dtype: torch.dtype, cached: list[int], new: list[int], window: int | None,
    splits: int | None,
) -> None:
    q_dtype = torch.float16 if INTERPRETED else torch.bfloat16
    (q, k, v, kc, vc), scales, meta = fp8_case(cached, new, dtype, q_dtype, 7)
    ref_kc, ref_vc = kc.clone(), vc.clone()
    expected = get_backend("reference").forward(
        q.float(), k.float(), v.float(), ref_kc, ref_vc, fresh(meta), 0.25, window,
        kv_scales=scales,
    )
    out = TritonAttention(splits).forward(q, k, v, kc, vc, fresh(meta), 0.25, window,
                                          kv_scales=scales)
    # The writes are the same bytes; the reads differ only by the half-precision products.
    assert torch.equal(kc.view(torch.uint8), ref_kc.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), ref_vc.view(torch.uint8))
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_an_fp8_cache_without_scales_is_refused(backend: str) -> None:
    (q, k, v, kc, vc), _, meta = fp8_case([0], [2], torch.float8_e4m3fn, torch.float32, 2)
    with pytest.raises(ValueError, match="kv_scales"):
        get_backend(backend).forward(q, k, v, kc, vc, fresh(meta), 0.25)


def test_the_cache_takes_scales_exactly_when_fp8_and_halves_the_bytes() -> None:
    scales = [KVScales.of(1.0, 1.0, DEVICE)] * 2
    cache = KVCache.allocate(2, 3, 4, 2, 8, torch.float8_e5m2, DEVICE, scales)
    assert cache.scales_of(1) is scales[1] and cache.keys[0].dtype == torch.float8_e5m2
    assert KVCache.allocate(2, 3, 4, 2, 8, torch.bfloat16, DEVICE).scales_of(0) is None
    with pytest.raises(ValueError, match="scales"):
        KVCache.allocate(2, 3, 4, 2, 8, torch.float8_e5m2, DEVICE)
    with pytest.raises(ValueError, match="scales"):
        KVCache.allocate(2, 3, 4, 2, 8, torch.bfloat16, DEVICE, scales)
    fp8 = KVCache.bytes_per_token(4, 2, 8, kv_cache_dtype("fp8_e4m3fn", torch.bfloat16))
    assert 2 * fp8 == KVCache.bytes_per_token(4, 2, 8, kv_cache_dtype(None, torch.bfloat16))
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        kv_cache_dtype("fp8", torch.bfloat16)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="positive finite"):
            KVScales.of(bad, 1.0, DEVICE)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
def test_fp8_decode_replays_in_a_cuda_graph() -> None:
    """Captured once over an FP8 cache (its scales read from their tensors), replayed after the
    inputs, the lengths and the scales' values change in place on the device."""
    (q, k, v, kc, vc), scales, meta = fp8_case([40, 9, 100], [1] * 3, torch.float8_e4m3fn,
                                              torch.bfloat16, 19, block_size=16)
    backend = TritonAttention()
    captured = fresh(meta)
    backend.forward(q, k, v, kc, vc, captured, 0.25, kv_scales=scales)  # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, kc, vc, captured, 0.25, kv_scales=scales)
    later = AttentionMetadata.build([1] * 3, [41, 10, 101], meta.block_tables.tolist(), 16,
                                    DEVICE)
    ref_kc, ref_vc = kc.clone(), vc.clone()
    for dst, value in ((q, torch.randn_like(q)), (k, torch.randn_like(k)),
                       (v, torch.randn_like(v)), (captured.seqlens_k, later.seqlens_k),
                       (captured.slot_mapping, later.slot_mapping),
                       (scales.key, torch.tensor([0.75], device=DEVICE))):
        dst.copy_(value)
    graph.replay()
    expected = get_backend("reference").forward(
        q.float(), k.float(), v.float(), ref_kc, ref_vc, fresh(later), 0.25, kv_scales=scales)
    assert torch.equal(kc.view(torch.uint8), ref_kc.view(torch.uint8))
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)

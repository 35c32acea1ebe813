"""The paged KV-cache write as one Triton kernel: each new token's K/V rows go to their slot.

One program per token copies all KV heads of that token's key and value rows to
`slot // block_size, slot % block_size` of the caches. A negative slot means "no slot" (a padded
row, e.g. a CUDA-graph batch padded to its bucket) and the token is skipped, so padding never needs
a scratch slot of its own. Inputs may be strided views (k and v are slices of the fused QKV
projection); the values are cast to the cache's dtype on store, or, for an FP8 cache, divided by
the layer's scale in float32 and stored as FP8 bytes (shard/attention/triton_fp8.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pytgi_shard.attention.kv_quant import KVScales
from pytgi_shard.attention.triton_fp8 import fp8_code, fp8_encode, kernel_view, scale_args


@triton.jit
def _store_rows(cache_ptr, dst, x, scale_ptr, mask, FP8: tl.constexpr):
    """x as the cache holds it: cast, or divided by the scale and encoded as FP8 bytes (an IEEE
    division, as the reference's: `/` compiles to an approximate one on CUDA)."""
    if FP8 == 0:
        tl.store(cache_ptr + dst, x.to(cache_ptr.dtype.element_ty), mask=mask)
    else:
        scaled = tl.math.div_rn(x.to(tl.float32), tl.load(scale_ptr))
        tl.store(cache_ptr + dst, fp8_encode(scaled, FP8), mask=mask)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_co, stride_ch, stride_cd,
    num_kv_heads, head_dim, block_size,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)
    block = slot // block_size
    offset = slot % block_size
    dst = block * stride_cb + offset * stride_co + heads[:, None] * stride_ch + dims[None, :] * stride_cd
    k_src = k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd
    v_src = v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd
    key = tl.load(k_src, mask=mask)
    value = tl.load(v_src, mask=mask)
    _store_rows(key_cache_ptr, dst, key, k_scale_ptr, mask, FP8)
    _store_rows(value_cache_ptr, dst, value, v_scale_ptr, mask, FP8)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: KVScales | None = None,
) -> None:
    """Stores k/v [T, Hkv, D] at slot_mapping [T] of the caches [blocks, block_size, Hkv, D].

    Tokens whose slot is negative are left out. The grid depends only on T, and an FP8 cache's
    scales are read from their tensors on the device, so the write is capturable in a CUDA graph.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if key_cache.stride() != value_cache.stride() or key_cache.dtype != value_cache.dtype:
        raise ValueError("key and value caches must share one layout and dtype")
    k_scale, v_scale = scale_args(key_cache, kv_scales, slot_mapping)
    _write_kv_kernel[(num_tokens,)](
        k, v, kernel_view(key_cache), kernel_view(value_cache), slot_mapping, k_scale, v_scale,
        *k.stride(), *v.stride(), *key_cache.stride(),
        num_kv_heads, head_dim, key_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        FP8=fp8_code(key_cache),
    )

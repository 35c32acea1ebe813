"""The paged KV-cache write as one Triton kernel: each new token's K/V rows go to their slot.

One program per token copies all KV heads of that token's key and value rows to
`slot // block_size, slot % block_size` of the caches. A negative slot means "no slot" (a padded
row, e.g. a CUDA-graph batch padded to its bucket) and the token is skipped, so padding never needs
a scratch slot of its own. Inputs may be strided views (k and v are slices of the fused QKV
projection); the values are cast to the cache's dtype on store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_co, stride_ch, stride_cd,
    num_kv_heads, head_dim, block_size,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
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
    tl.store(key_cache_ptr + dst, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dst, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Stores k/v [T, Hkv, D] at slot_mapping [T] of the caches [blocks, block_size, Hkv, D].

    Tokens whose slot is negative are left out. The grid depends only on T, so the write is
    capturable in a CUDA graph.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if key_cache.stride() != value_cache.stride():
        raise ValueError("key and value caches must share one layout")
    _write_kv_kernel[(num_tokens,)](
        k, v, key_cache, value_cache, slot_mapping,
        *k.stride(), *v.stride(), *key_cache.stride(),
        num_kv_heads, head_dim, key_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )

"""Rotary embedding of queries and keys in one Triton kernel.

Eager, each of q and k takes four ops (two products, a cat, a sum) and the factor tables are
built per forward; fused, one launch reads q and k once (straight from the strided views of the
qkv projection's output) and writes them rotated and contiguous, as attention wants them. The
products and the sum are rounded to the model dtype as the eager ops round them, with the same
factors (cos and sin rounded to the model dtype): bit-identical under Triton's interpreter;
compiled on an H100 some half-precision elements differed from eager CUDA by one ulp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(x_ptr, out_ptr, row, heads, stride_xt, stride_xh, cos, sin,
            HALF: tl.constexpr, BLOCK_H: tl.constexpr):  # fmt: skip
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HALF)[None, :]
    mask = h < heads
    src = x_ptr + row * stride_xt + h * stride_xh + d
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    a = (x1.to(tl.float32) * cos).to(dtype).to(tl.float32)
    b = (x2.to(tl.float32) * -sin).to(dtype).to(tl.float32)
    c = (x2.to(tl.float32) * cos).to(dtype).to(tl.float32)
    e = (x1.to(tl.float32) * sin).to(dtype).to(tl.float32)
    dst = out_ptr + row * heads * (2 * HALF) + h * (2 * HALF) + d
    tl.store(dst, (a + b).to(dtype), mask=mask)
    tl.store(dst + HALF, (c + e).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
    q_heads, k_heads, stride_qt, stride_qh, stride_kt, stride_kh, stride_ct,
    HALF: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HALF)[None, :]
    # The factors as the eager path uses them: rounded to the model dtype.
    dtype = q_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + row * stride_ct + d).to(dtype).to(tl.float32)
    sin = tl.load(sin_ptr + row * stride_ct + d).to(dtype).to(tl.float32)
    _rotate(q_ptr, q_out_ptr, row, q_heads, stride_qt, stride_qh, cos, sin, HALF, BLOCK_QH)
    _rotate(k_ptr, k_out_ptr, row, k_heads, stride_kt, stride_kh, cos, sin, HALF, BLOCK_KH)


def rotate_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [tokens, Hq, D] and k [tokens, Hkv, D] rotated (rotate-half layout), contiguous.

    cos, sin: float32 [tokens, D / 2] (RotaryEmbedding.cos_sin). q and k may be strided views;
    their last dimension must be contiguous. D / 2 must be a power of two.
    """
    tokens, q_heads, dim = q.shape
    half = dim // 2
    if q.stride(-1) != 1 or k.stride(-1) != 1 or half & (half - 1) or dim % 2:
        raise ValueError("rotate_qk needs contiguous head dims and a power-of-two half dim")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if tokens == 0:
        return q_out, k_out
    cos, sin = cos.contiguous(), sin.contiguous()
    _rotary_kernel[(tokens,)](
        q, k, cos, sin, q_out, k_out,
        q_heads, k.shape[1], q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        HALF=half, BLOCK_QH=triton.next_power_of_2(q_heads),
        BLOCK_KH=triton.next_power_of_2(k.shape[1]), num_warps=4,
    )  # fmt: skip
    return q_out, k_out

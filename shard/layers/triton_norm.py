"""Residual add + RMSNorm in one Triton kernel: one read of each input, one write of each output.

Unfused, a decoder layer's `h = h + attn(...)` then `rms_norm(h)` in half precision makes five
passes over the hidden states (add, upcast, normalise, downcast, scale); fused it is one. The
arithmetic reproduces the unfused path's roundings: the sum is rounded to the model dtype (as
the eager add stores it), the statistics are float32, the normalised value is rounded to the
model dtype before the weight multiplies it (as Hugging Face's Llama does), and that product is
rounded once more.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr,
    hidden, stride_x, stride_r, stride_o, stride_s, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # The eager add rounds the sum to the model dtype before anything reads it.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / hidden
    normed = (xf * tl.math.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual) for x, residual [tokens, hidden].

    Without a residual the second result is x itself. Both inputs keep their values; the sum is
    a new tensor (the caller's next residual).
    """
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError("add_rms_norm takes a 2-D tensor with contiguous rows")
    tokens, hidden = x.shape
    out = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else x
    if tokens == 0:
        return out, total
    block = triton.next_power_of_2(hidden)
    _add_rms_norm_kernel[(tokens,)](
        x, residual if residual is not None else x, weight, out, total,
        hidden, x.stride(0), residual.stride(0) if residual is not None else 0,
        out.stride(0), total.stride(0), eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=min(max(block // 256, 1), 16),
    )  # fmt: skip
    return out, total

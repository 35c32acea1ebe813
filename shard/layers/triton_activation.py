"""act(gate) * up in one Triton kernel, reading the fused gate_up projection's output in place.

Eager, `gate, up = gate_up.chunk(2)` then `act(gate) * up` reads the [tokens, 2 * inter] output
twice and writes an intermediate [tokens, inter] tensor; fused it is one read and one write. The
activation's result is rounded to the model dtype before the multiply, as the eager ops round it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gated_act_kernel(
    gate_up_ptr, out_ptr, inter, stride_in, stride_out,
    ACT: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + inter + cols, mask=mask, other=0.0)
    if ACT == "silu":
        act = gate * tl.sigmoid(gate)
    elif ACT == "gelu_tanh":
        # sqrt(2 / pi) as a literal: compiled Triton refuses non-constexpr globals.
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        # tanh through exp of a non-positive argument, which cannot overflow.
        decay = tl.exp(-2.0 * tl.abs(inner))
        tanh = tl.where(inner >= 0, 1.0, -1.0) * (1.0 - decay) / (1.0 + decay)
        act = 0.5 * gate * (1.0 + tanh)
    else:  # exact (erf) GELU
        act = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476))
    act = act.to(out_ptr.dtype.element_ty).to(tl.float32)
    y = act * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


# The gated MLP's activation names (transformers' hidden_act) the kernel computes.
KERNEL_ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}


def gated_activation(gate_up: torch.Tensor, hidden_act: str) -> torch.Tensor:
    """act(gate_up[:, :inter]) * gate_up[:, inter:] for gate_up [tokens, 2 * inter]."""
    if gate_up.dim() != 2 or gate_up.stride(-1) != 1 or gate_up.shape[1] % 2:
        raise ValueError("gated_activation takes [tokens, 2 * inter] with contiguous rows")
    tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(tokens, inter)
    if tokens == 0:
        return out
    block = min(triton.next_power_of_2(inter), 1024)
    grid = (tokens, triton.cdiv(inter, block))
    _gated_act_kernel[grid](
        gate_up, out, inter, gate_up.stride(0), out.stride(0),
        ACT=KERNEL_ACTIVATIONS[hidden_act], BLOCK=block, num_warps=4,
    )  # fmt: skip
    return out

"""The experts of a sparse MoE block in plain PyTorch, tokens grouped by expert.

The (token, expert) assignments are sorted by expert, so each expert's tokens form one contiguous
group; each expert then runs its MLP once, as three matmuls over its whole group, and the
weighted results are added back to their tokens:

    for each expert e with tokens:   y = down_e(act(gate_e(x_g)) * up_e(x_g)) * w_g
                                     out[tokens_g] += y

The loop is over experts that have tokens, never over tokens. It reads the group sizes on the
host (one synchronisation per block), so it is the CPU path and the oracle of the Triton grouped
GEMM (triton_grouped_gemm.py), and is not capturable in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def grouped_experts(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """sum over each token's k experts of weight * expert(x), for x [tokens, hidden].

    experts, weights: [tokens, k], experts in 0..E where E = gate_up.shape[0] marks an expert this
    rank does not hold (skipped); gate_up [E, 2 * inter, hidden]; down [E, hidden, inter].
    """
    num_experts = gate_up.shape[0]
    top_k = experts.shape[1]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sizes = torch.bincount(flat, minlength=num_experts + 1)[:num_experts].tolist()
    flat_weights = weights.reshape(-1, 1)
    out = torch.zeros_like(x)
    start = 0
    for e, size in enumerate(sizes):
        if size == 0:
            continue
        assignments = order[start : start + size]
        tokens = assignments // top_k
        gate, up = F.linear(x[tokens], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(act(gate) * up, down[e]) * flat_weights[assignments]
        out.index_add_(0, tokens, y)
        start += size
    return out


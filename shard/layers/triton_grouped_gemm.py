"""The experts of a sparse MoE block as two Triton grouped GEMMs over tokens sorted by expert.

    h = grouped_gemm(x gathered by token, gate_up[e])     [rows, 2 * inter]   rows: expert_blocks
    a = act(h_gate) * h_up                                [rows, inter]       (triton_activation)
    y = grouped_gemm(a, down[e]) * routing weight          scattered to [tokens * k, hidden]
    out = y.view(tokens, k, hidden).sum(1)

Each program computes one [BLOCK_M, BLOCK_N] tile of one expert: the rows of a tile all belong to
that expert (expert_blocks.py pads each expert's group to whole tiles), so the tile reads one
expert's weights and its tokens' rows, and a tile past the last expert's does no work. Every
shape depends only on the number of tokens and every index stays on the device: unlike the
grouped PyTorch path (grouped_experts.py), which reads the group sizes back to the host, this
path is CUDA-graph capturable, and it is the one a Llama-style MoE model runs on CUDA, for decode
and prefill alike. That it beats the grouped PyTorch path there is argued, not yet measured (no
GPU in the session that wrote it): two kernel launches and no host round trip per block against
three cuBLAS calls per expert with tokens plus a synchronisation, which for 64-128 experts is
hundreds of small launches; at large prefills with few experts (Mixtral) cuBLAS per expert may
still win, which timing the two paths on a GPU would show.

Only APIs of Triton 3.6 and later are used (no tensor descriptors, plain `range`); the tests pass
under the interpreters of Triton 3.9 and 3.6 (3.6's needs numpy < 2.4, as every kernel here does).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from pytgi_shard.attention.triton_online_softmax import dot_precision
from pytgi_shard.layers.expert_blocks import ExpertBlocks, expert_blocks


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, sorted_ids_ptr, block_experts_ptr, scale_ptr,
    n, k, num_assignments, num_experts,
    stride_am, stride_be, stride_bn, stride_bk, stride_cm,
    TOP_K: tl.constexpr, GATHER: tl.constexpr, SCATTER: tl.constexpr, SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """c[row] = a[row'] @ b[expert]^T for the rows of this tile (row' = the assignment's token
    when GATHER, else the row itself), times the assignment's weight when SCALE, stored at the
    assignment's index when SCATTER (padding rows dropped), else at the row."""
    tile = tl.program_id(0)
    expert = tl.load(block_experts_ptr + tile)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    ids = tl.load(sorted_ids_ptr + rows)
    valid = ids < num_assignments
    a_rows = ids // TOP_K if GATHER else rows
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n
    # A tile past the last expert's (expert id num_experts) runs no iteration and stores zeros.
    k_end = tl.where(expert < num_experts, k, 0)
    b_base = b_ptr + tl.minimum(expert, num_experts - 1).to(tl.int64) * stride_be
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k
        a = tl.load(
            a_ptr + a_rows.to(tl.int64)[:, None] * stride_am + ks[None, :],
            mask=valid[:, None] & k_mask[None, :], other=0.0,
        )
        b = tl.load(
            b_base + cols[None, :] * stride_bn + ks[:, None] * stride_bk,
            mask=k_mask[:, None] & col_mask[None, :], other=0.0,
        )
        acc += tl.dot(a, b, input_precision=PRECISION)
    if SCALE:
        acc = acc * tl.load(scale_ptr + ids, mask=valid, other=0.0).to(tl.float32)[:, None]
    if SCATTER:
        out_rows = ids
        row_mask = valid
    else:
        # Every row of the layout is written, padding as zeros (its A rows load as 0), so the
        # activation between the GEMMs never reads uninitialised memory.
        out_rows = rows
        row_mask = rows >= 0
    tl.store(
        c_ptr + out_rows.to(tl.int64)[:, None] * stride_cm + cols[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


def tile_rows(num_assignments: int, num_experts: int) -> int:
    """BLOCK_M: 16 rows when experts average only a few tokens (decode), where larger tiles
    would mostly compute padding; 64 once they get enough tokens to fill them."""
    return 16 if num_assignments < 8 * num_experts else 64


def grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    blocks: ExpertBlocks,
    out: torch.Tensor,
    *,
    gather_top_k: int | None = None,
    scale: torch.Tensor | None = None,
    scatter: bool = False,
) -> torch.Tensor:
    """out[row] = a[row or its token] @ b[expert of row]^T for every row of `blocks` (see the
    kernel), b [experts, n, k]; returns `out`."""
    num_experts, n, k = b.shape
    if a.stride(-1) != 1 or b.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("grouped_gemm takes row-major a, b and out")
    tiles = blocks.block_experts.numel()
    if tiles == 0:
        return out
    block_n = 64
    block_k = 64 if k >= 64 else 32 if k >= 32 else 16
    grid = (tiles, triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, b, out, blocks.sorted_ids, blocks.block_experts,
        scale if scale is not None else a,
        n, k, blocks.num_assignments, num_experts,
        a.stride(0), b.stride(0), b.stride(1), b.stride(2), out.stride(0),
        TOP_K=gather_top_k or 1, GATHER=gather_top_k is not None, SCATTER=scatter,
        SCALE=scale is not None, BLOCK_M=blocks.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION=dot_precision(a.dtype == torch.float32), num_warps=4,
    )  # fmt: skip
    return out


def triton_experts(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """grouped_experts' result (same arguments) through the grouped GEMMs; `activation` maps
    [rows, 2 * inter] to act(gate) * up [rows, inter] (the fused kernel on CUDA)."""
    tokens, top_k = experts.shape
    num_experts, _, hidden = gate_up.shape
    blocks = expert_blocks(experts, num_experts, tile_rows(experts.numel(), num_experts))
    rows = blocks.sorted_ids.numel()
    h = grouped_gemm(
        x, gate_up, blocks, x.new_empty(rows, gate_up.shape[1]), gather_top_k=top_k
    )
    a = activation(h)
    # Zeros: assignments to experts of other ranks (expert parallel) get no row and add nothing.
    y = x.new_zeros(tokens * top_k, hidden)
    grouped_gemm(a, down, blocks, y, scale=weights.reshape(-1).contiguous(), scatter=True)
    return y.view(tokens, top_k, hidden).sum(dim=1)

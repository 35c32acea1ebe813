"""y = x @ W^T in Triton for a group-quantized W kept packed (GPTQ's layout): each tile of W is
unpacked, shifted by its zero points and scaled in registers, then fed to tl.dot, so W is read
from memory at 4 or 8 bits a weight and never materialised in full.

g_idx is read per input feature, so act-order weights (and a row shard of one, whose features
hit groups unevenly) need no permutation: nothing maintained in PyTorch covers that case on GPU,
and fp16 activations, which PyTorch's int4 op refuses on CUDA. Small batches (decode) leave most
SMs idle with one program per output tile, so the K loop is split over `split_k` programs whose
float32 partial sums are added afterwards (deterministically, no atomics).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pytgi_shard.attention.triton_online_softmax import dot_precision
from pytgi_shard.quantization.packed_int_weight import PackedIntWeight

MAX_SPLIT_K = 16


@triton.jit
def _dequant_gemm_kernel(
    x_ptr, qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, out_ptr,
    M, N, K, stride_xm, stride_part, k_tiles_per_split,
    BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    PACK: tl.constexpr = 32 // BITS
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first_tile = split * k_tiles_per_split
    for tile in range(first_tile, first_tile + k_tiles_per_split):
        offs_k = tile * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
            mask=m_mask[:, None] & k_mask[None, :], other=0.0,
        )  # fmt: skip
        w_mask = k_mask[:, None] & n_mask[None, :]
        words = tl.load(
            qweight_ptr + (offs_k // PACK)[:, None].to(tl.int64) * N + offs_n[None, :],
            mask=w_mask, other=0,
        )  # fmt: skip
        # Arithmetic shifts of negative words bring in sign bits; the mask drops them.
        q = (words >> ((offs_k % PACK) * BITS)[:, None]) & ((1 << BITS) - 1)
        group = tl.load(g_idx_ptr + offs_k, mask=k_mask, other=0)
        at_group = group[:, None].to(tl.int64) * N + offs_n[None, :]
        scale = tl.load(scales_ptr + at_group, mask=w_mask, other=0.0).to(tl.float32)
        zero = tl.load(zeros_ptr + at_group, mask=w_mask, other=0.0).to(tl.float32)
        # Exact in float32, rounded once to the activations' dtype, as dequantize() rounds.
        w = ((q.to(tl.float32) - zero) * scale).to(x.dtype)
        acc += tl.dot(x, w, input_precision=PRECISION)
    out = out_ptr + split.to(tl.int64) * stride_part
    out += offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out, acc, mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes of one launch and how many programs share the K loop."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int


def gemm_config(
    m: int, n: int, k: int, device: torch.device, split_k: int | None = None
) -> GemmConfig:
    """Tiles by batch size (16 rows is tl.dot's minimum; 64 once the batch fills it) and a K
    split that brings small-batch launches to about two programs per SM."""
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n, block_k = 64, 64
    k_tiles = triton.cdiv(k, block_k)
    if split_k is None:
        sms = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else 1
        )
        programs = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
        split_k = max(1, min(MAX_SPLIT_K, k_tiles, triton.cdiv(2 * sms, programs)))
    return GemmConfig(block_m, block_n, block_k, max(1, min(split_k, k_tiles)), 4)


def dequant_gemm(
    x: torch.Tensor, weight: PackedIntWeight, split_k: int | None = None
) -> torch.Tensor:
    """x [..., in] @ W^T -> [..., out] in x's dtype."""
    x2d = x.reshape(-1, weight.in_features).contiguous()
    m, n, k = x2d.shape[0], weight.out_features, weight.in_features
    if m == 0:
        return x.new_empty(*x.shape[:-1], n)
    cfg = gemm_config(m, n, k, x.device, split_k)
    k_tiles = triton.cdiv(k, cfg.block_k)
    tiles_per_split = triton.cdiv(k_tiles, cfg.split_k)
    splits = triton.cdiv(k_tiles, tiles_per_split)
    parts = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), splits)
    _dequant_gemm_kernel[grid](
        x2d, weight.qweight, weight.scales, weight.zeros, weight.g_idx, parts,
        m, n, k, x2d.stride(0), m * n, tiles_per_split,
        BITS=weight.bits, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PRECISION=dot_precision(x.dtype == torch.float32), num_warps=cfg.num_warps,
    )  # fmt: skip
    out = parts[0] if splits == 1 else parts.sum(dim=0)
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


class TritonIntWeight(PackedIntWeight):
    """PackedIntWeight's storage, multiplied by the Triton kernel instead of dequantized whole."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dequant_gemm(x, self)

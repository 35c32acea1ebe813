"""The LoRA update as a Triton kernel pair over the slot tensors (layer.py), the BGMV/SGMV idea
of Punica and S-LoRA: `shrink` h = x·A[slot]ᵀ per row, then `expand` y += h·Bᵀ[slot].

Each program takes a tile of BLOCK_M rows and one adapter slot (grid axis 1: slots 1..S-1) and
works on the rows of that tile whose slot it is, masked; a program whose tile holds no row of its
slot returns at once. The slot of each row is read on the device, so neither the grid nor any
shape depends on which adapters a step uses: the launch is capturable in a CUDA graph, and one
kernel pair serves decode (rows of mixed slots: BGMV) and prefill (a request's rows contiguous,
so most tiles hold one slot: SGMV's segments without a host-side segment list). The shrink splits
the input dimension over SPLIT_K programs that add into h atomically (float32), so that a decode
step's few row tiles still fill the GPU. Each (row, output column) of y belongs to exactly one
slot, so the expand adds into y without atomics. Written for Triton 3.6 to 3.9; tested under
TRITON_INTERPRET=1 against torch_lora.reference_update.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def dot_precision(fp32: bool) -> str:
    """fp32 inputs get exact ("ieee") products, matching the reference; halves use tensor cores
    (as the attention kernels do)."""
    return "ieee" if fp32 else "tf32"


@triton.jit
def _tile_has_slot(index_ptr, rows, T, slot):
    """The slots of the tile's rows (-1 past the end) and whether any row uses `slot`."""
    slots = tl.load(index_ptr + rows, mask=rows < T, other=-1)
    return slots, tl.sum((slots == slot).to(tl.int32), axis=0) > 0


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, h_ptr, index_ptr, T, K, R,
                   stride_xm, stride_as, stride_ar, stride_ak, stride_hm,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   K_PER_SPLIT: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    slot = tl.program_id(1) + 1
    split = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots, present = _tile_has_slot(index_ptr, rows, T, slot)
    if present:
        mine = slots == slot
        ranks = tl.arange(0, BLOCK_R)
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(split * K_PER_SPLIT, (split + 1) * K_PER_SPLIT, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                        mask=mine[:, None] & (ks[None, :] < K), other=0.0)
            # A[slot] read as [BLOCK_K, BLOCK_R] (Aᵀ's tile).
            a = tl.load(a_ptr + slot * stride_as + ranks[None, :] * stride_ar
                        + ks[:, None] * stride_ak,
                        mask=(ranks[None, :] < R) & (ks[:, None] < K), other=0.0)
            acc += tl.dot(x, a.to(x.dtype), input_precision=PRECISION)
        tl.atomic_add(h_ptr + rows[:, None] * stride_hm + ranks[None, :], acc,
                      mask=mine[:, None] & (ranks[None, :] < R))


@triton.jit
def _expand_kernel(h_ptr, bt_ptr, y_ptr, index_ptr, T, N, R,
                   stride_hm, stride_bs, stride_br, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                   PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    slot = tl.program_id(1) + 1
    pid_n = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots, present = _tile_has_slot(index_ptr, rows, T, slot)
    if present:
        mine = slots == slot
        ranks = tl.arange(0, BLOCK_R)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        b = tl.load(bt_ptr + slot * stride_bs + ranks[:, None] * stride_br + cols[None, :],
                    mask=(ranks[:, None] < R) & (cols[None, :] < N), other=0.0)
        h = tl.load(h_ptr + rows[:, None] * stride_hm + ranks[None, :],
                    mask=mine[:, None] & (ranks[None, :] < R), other=0.0)
        delta = tl.dot(h.to(b.dtype), b, input_precision=PRECISION)
        out = mine[:, None] & (cols[None, :] < N)
        y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :]
        y = tl.load(y_ptrs, mask=out, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=out)


def _block_m(tokens: int) -> int:
    """Rows per tile: a power of two between 16 (tl.dot's minimum) and 64, fitting the step."""
    return max(16, min(64, triton.next_power_of_2(max(tokens, 1))))


def _split_k(k: int, block_k: int, tiles: int, device: torch.device) -> int:
    """Input-dimension splits of the shrink: enough programs for the GPU when the row tiles
    are few (decode), at least one BLOCK_K per split."""
    if device.type != "cuda":
        return min(2, triton.cdiv(k, block_k))
    return max(1, min(triton.cdiv(k, block_k), triton.cdiv(64, tiles), 16))


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
             index: torch.Tensor) -> None:
    """y [T, out] += each row's (x [T, in] · A[slot]ᵀ) · Bᵀ[slot] in place; `index` [T] the
    rows' slots (0: base, untouched). `a` [S, R, in] (any strides: LoraLinear's is a
    transposed view of its [S, in, R] storage) and `bt` [S, R, out] contiguous."""
    tokens, k = x.shape
    slots, rank, n = bt.shape
    if tokens == 0 or slots < 2:
        return
    x = x.contiguous()
    index = index.to(torch.int32).contiguous()
    h = torch.zeros(tokens, rank, dtype=torch.float32, device=x.device)
    block_m, block_r = _block_m(tokens), max(16, triton.next_power_of_2(rank))
    cuda = x.device.type == "cuda"
    block_k, block_n = (64, 64) if cuda else (16, 16)
    tiles = triton.cdiv(tokens, block_m)
    split = _split_k(k, block_k, tiles, x.device)
    per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    precision = dot_precision(x.dtype == torch.float32)
    _shrink_kernel[(tiles, slots - 1, triton.cdiv(k, per_split))](
        x, a, h, index, tokens, k, rank,
        x.stride(0), a.stride(0), a.stride(1), a.stride(2), h.stride(0),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, K_PER_SPLIT=per_split,
        PRECISION=precision)
    if y.stride(1) != 1:
        raise ValueError("add_lora: y's rows must be contiguous")
    _expand_kernel[(tiles, slots - 1, triton.cdiv(n, block_n))](
        h, bt, y, index, tokens, n, rank,
        h.stride(0), bt.stride(0), bt.stride(1), y.stride(0),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_N=block_n, PRECISION=precision)

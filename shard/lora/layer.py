"""LoRA applied per row: each adapted linear layer adds scale·(x·Aᵀ)·Bᵀ to the rows of each
adapter present in the forward, the base model's rows untouched.

Every adapter's weights live in per-slot tensors of the layer (slot i = wire adapter index i,
slot 0 the base model: zeros), `a` [slots, max_rank, in] (a view of the storage `at`
[slots, in, max_rank]: A transposed, the layout the CPU's batched shrink reads fastest) and `bt`
[slots, max_rank, out] (B transposed, so that a tile of one slot's output columns is contiguous
for the kernel and a slot's rank rows for the CPU's expand), written only through `LoraLinear.set_slot` — the
one write path, used at start-up (attach.py) and by live load/unload. The rows say which slot
each flat token uses through one index tensor (`RowAdapters.index`), so the update needs no
host read of it: on CUDA a Triton shrink/expand kernel pair (triton_lora.py, the BGMV/SGMV idea
of Punica/S-LoRA) reads it on the device, which lets decode steps with adapters run under CUDA
graphs (the index is a graph input); on the CPU one call per layer of a small C++ kernel
(cpu_lora.cpp, built at start-up by cpu_kernel.py), or torch ops (torch_lora.py) where it
cannot be built or elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from pytgi_shard.layers.linear import RowParallelLinear
from pytgi_shard.lora import cpu_kernel, torch_lora

# LoraLinear.path values: the Triton kernel pair (CUDA), the fused C++ kernel (CPU), or torch ops.
TRITON_PATH = "triton"
CPU_KERNEL_PATH = "cpu_kernel"
TORCH_PATH = "torch"


@dataclass(slots=True)
class RowAdapters:
    """The current forward's adapter slot of each flat token (None: every row runs the base
    model): shared by every LoraLinear of one model, bound by the ModelRunner (or the decode
    graphs' static buffer) around each forward."""

    index: torch.Tensor | None = None
    # The rows of each slot as padded segments, built on the first request of a forward, only
    # by the path that asks for it (torch's segmented path on the CPU, where the host read
    # costs no device sync), and shared by the forward's layers.
    _segments: torch_lora.Segments | None = field(default=None, repr=False)

    def bind(self, adapters: torch.Tensor | None) -> None:
        """`adapters`: one slot index per flat token (0: base), kept as given (no host read)."""
        self.index = adapters
        self._segments = None

    def segments(self, slots: int) -> torch_lora.Segments:
        """The bound rows' segments over `slots` slots (built once per forward and reused by
        every layer: the row permutation is the same in each; every layer of one model has the
        same slot count)."""
        assert self.index is not None
        seg = self._segments
        if seg is None or seg.slots != slots:
            seg = self._segments = torch_lora.segments(self.index, slots)
        return seg

    def clear(self) -> None:
        self.index = None
        self._segments = None


class LoraLinear(nn.Module):
    """base(x) plus each row's adapter's low-rank update.

    Fused layers (q|k|v, gate|up: `pieces`, each piece's local output size) stack the pieces' A
    and place each piece's B in its own output rows, so one shrink serves the whole fused
    output. The slot's rank columns are split evenly over the pieces (piece p: columns
    [p·max_rank/P, (p+1)·max_rank/P)), so the CPU expands each piece from its own columns only
    (a q|k|v expand at a third of the block-diagonal B's work). On several ranks each holds the slices of A
    and B that match its slice of the layer (shard/lora/attach.py); a row-parallel layer's
    update, computed from this rank's input slice, is added before the all-reduce, which sums it
    with the others'.
    """

    # The slot tensors (buffers): A transposed [slots, in, max_rank] and B transposed
    # [slots, max_rank, out] (`bt_0`), or per fused piece (`bt_0`..: `split`).
    at: torch.Tensor
    bt_0: torch.Tensor

    def __init__(self, base: nn.Module, rows: RowAdapters, *, in_features: int,
                 out_features: int, slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device, path: str = TORCH_PATH,
                 pieces: Sequence[int] | None = None) -> None:
        super().__init__()
        if slots < 2 or max_rank < 1:
            raise ValueError(f"LoraLinear needs >= 2 slots and max_rank >= 1, got {slots}, "
                             f"{max_rank}")
        self.base = base
        self.rows = rows
        self.path = path
        self.pieces = tuple(pieces or (out_features,))
        if sum(self.pieces) != out_features or max_rank % len(self.pieces):
            raise ValueError(f"LoraLinear: pieces {self.pieces} do not split {out_features} "
                             f"outputs and rank {max_rank} evenly")
        self.register_buffer("at", torch.zeros(slots, in_features, max_rank, dtype=dtype,
                                               device=device), persistent=False)
        self.out_features = out_features
        # A fused layer on the CPU keeps each piece's B apart, contiguous ([slots,
        # max_rank/P, piece's outputs]: the expand reads only the nonzero blocks, measured
        # ~35% faster on the demo gate|up than a strided slice of the block-diagonal B);
        # elsewhere one block-diagonal B (the kernel's and the dense path's layout).
        self.split = (len(self.pieces) > 1 and path in (TORCH_PATH, CPU_KERNEL_PATH)
                      and torch.device(device).type == "cpu")
        # The built C++ kernel (CPU_KERNEL_PATH): None when it could not be built here (one
        # warning logged by cpu_kernel.load), and the layer then takes the torch ops.
        self.kernel = cpu_kernel.load() if path == CPU_KERNEL_PATH else None
        shapes = ([(max_rank // len(self.pieces), size) for size in self.pieces] if self.split
                  else [(max_rank, out_features)])
        self._b_names = tuple(f"bt_{p}" for p in range(len(shapes)))
        for p, (rank, size) in enumerate(shapes):
            self.register_buffer(f"bt_{p}", torch.zeros(slots, rank, size, dtype=dtype,
                                                         device=device), persistent=False)
        # Each slot's rank (0: empty), on the host, for the adapters' owners (live load/unload).
        self.ranks = [0] * slots

    @property
    def a(self) -> torch.Tensor:
        """The slots' A as [slots, max_rank, in] (a view of `at`: writes through it land in
        the storage)."""
        return self.at.transpose(1, 2)

    @property
    def b_pieces(self) -> tuple[torch.Tensor, ...]:
        """The B storage: one [slots, max_rank, out] tensor, or per piece [slots,
        max_rank/P, piece's outputs] (`split`)."""
        return tuple(getattr(self, name) for name in self._b_names)

    @property
    def bt(self) -> torch.Tensor:
        """The slots' Bᵀ as [slots, max_rank, out], block-diagonal over the pieces: the
        storage itself, or (split layers) a copy assembled from the pieces."""
        pieces = self.b_pieces
        if not self.split:
            return pieces[0]
        out = pieces[0].new_zeros(self.slots, self.max_rank, self.out_features)
        rank, start = self.max_rank // len(pieces), 0
        for p, piece in enumerate(pieces):
            out[:, p * rank:(p + 1) * rank, start:start + piece.shape[2]] = piece
            start += piece.shape[2]
        return out

    @property
    def slots(self) -> int:
        return self.a.shape[0]

    @property
    def max_rank(self) -> int:
        return self.a.shape[1]

    def set_slot(self, index: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Writes adapter `index`'s (≥ 1, its wire index) A [rank, in] and B [out, rank] (scale
        folded into B) into its slot, or clears the slot (both None: the rows of that index then
        run the base model). With P pieces, `rank` is P·r, piece p's rank being rows of A /
        columns of B [p·r, (p+1)·r) (zeros where the adapter does not adapt the piece:
        attach._fused_pair's layout); each goes to the piece's own columns of the slot. In
        place: the slot tensors keep their addresses, so CUDA graphs captured over them stay
        valid. Raises ValueError for an index or rank beyond the capacity given at
        construction, or shapes that do not fit the layer."""
        if not 1 <= index < self.slots:
            raise ValueError(f"LoRA slot {index} is outside 1..{self.slots - 1}")
        self.at[index].zero_()
        for piece in self.b_pieces:
            piece[index].zero_()
        self.ranks[index] = 0
        if a is None or b is None:
            if a is not None or b is not None:
                raise ValueError("set_slot: give both A and B, or neither to clear the slot")
            return
        rank, count = a.shape[0], len(self.pieces)
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank or rank % count:
            raise ValueError(f"set_slot: A {tuple(a.shape)} and B {tuple(b.shape)} are not "
                             f"[rank, in] and [out, rank] with rank a multiple of {count}")
        if rank > self.max_rank:
            raise ValueError(f"LoRA slot {index}: rank {rank} exceeds this layer's capacity "
                             f"{self.max_rank}")
        if a.shape[1] != self.a.shape[2] or b.shape[0] != self.out_features:
            raise ValueError(f"LoRA slot {index}: A {tuple(a.shape)} / B {tuple(b.shape)} do not "
                             f"fit a {self.out_features}×{self.a.shape[2]} layer")
        r, stride, start = rank // count, self.max_rank // count, 0
        for p in range(count):
            self.a[index, p * stride:p * stride + r].copy_(a[p * r:(p + 1) * r])
            if self.split:
                end = start + self.pieces[p]
                getattr(self, f"bt_{p}")[index, :r].copy_(b[start:end, p * r:(p + 1) * r].t())
                start = end
            else:
                self.bt_0[index, p * stride:p * stride + r].copy_(b[:, p * r:(p + 1) * r].t())
        self.ranks[index] = rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base
        if isinstance(base, RowParallelLinear):
            return base.dist.all_reduce(self._add_updates(x, base.partial(x)))
        return self._add_updates(x, base(x))

    def _add_updates(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y plus each row's adapter update (in place on y's storage)."""
        index = self.rows.index
        if index is None:
            return y
        kernel = self.kernel
        if kernel is not None:
            # The buffers straight from the module's dict (no __getattr__ per call: this runs
            # for every adapted layer of every forward, where Python's overhead counts).
            buffers = self._buffers
            if kernel.add_lora(y, x, buffers["at"], [buffers[n] for n in self._b_names], index,
                               self.ranks):
                return y
        flat = x.reshape(-1, x.shape[-1])
        out = y.reshape(-1, y.shape[-1])
        if self.path == TRITON_PATH:
            from pytgi_shard.lora.triton_lora import add_lora

            add_lora(out, flat, self.a, self.bt, index)
        elif flat.device.type == "cpu":
            seg = self.rows.segments(self.slots)
            in_use = self.ranks[seg.first:seg.first + seg.count]
            used = max(in_use, default=0) // len(self.pieces) if self.split or len(
                self.pieces) == 1 else None
            torch_lora.add_segmented(out, flat, self.a, self.b_pieces, seg, used or None)
        else:
            torch_lora.add_dense(out, flat, self.a, self.bt, index)
        return y


def lora_rows_of(model: object) -> RowAdapters | None:
    """The rows holder the model's LoRA layers share (None: no layer is adapted), for the
    decode graphs, which bind it to their adapters buffer."""
    modules = model.modules() if isinstance(model, nn.Module) else ()
    return next((m.rows for m in modules if isinstance(m, LoraLinear)), None)

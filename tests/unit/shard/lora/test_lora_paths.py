"""The torch LoRA paths against the row-by-row float32 reference (torch_lora.reference_update):
the CPU's segmented update (through LoraLinear) and the dense one, over random slot tensors with
empty, cleared and partial-rank slots and rows of every slot including the base model's; and
LoraLinear.set_slot, the one write path. The Triton kernels: test_triton_lora.py."""

from __future__ import annotations

import pytest
import torch

from pytgi_shard.lora import torch_lora
from pytgi_shard.lora.layer import LoraLinear, RowAdapters


class _Zero(torch.nn.Module):
    """A base layer whose output is zeros, so the update alone is compared."""

    def __init__(self, out: int) -> None:
        super().__init__()
        self.out = out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(*x.shape[:-1], self.out)


def layer_with(slots: int, rank: int, k: int, n: int, dtype: torch.dtype, device: torch.device,
               seed: int, path: str = "torch") -> LoraLinear:
    """A LoraLinear with slot 1 at full rank, slot 2 at rank-2 (partial), the last slot empty
    (never set), the others full and one of them set then cleared (when there are enough)."""
    gen = torch.Generator().manual_seed(seed)
    layer = LoraLinear(_Zero(n), RowAdapters(), in_features=k, out_features=n, slots=slots,
                       max_rank=rank, dtype=dtype, device=device, path=path)
    for s in range(1, slots - 1):
        r = rank if s != 2 else max(1, rank - 2)
        a = torch.randn(r, k, generator=gen) * 0.5
        b = torch.randn(n, r, generator=gen) * 0.5
        layer.set_slot(s, a.to(device, dtype), b.to(device, dtype))
    if slots > 4:
        layer.set_slot(3, None, None)
    return layer


def rows_of(tokens: int, slots: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, slots, (tokens,), generator=gen)


def check(layer: LoraLinear, tokens: int, slots: int, seed: int, tol: float) -> None:
    gen = torch.Generator().manual_seed(seed + 100)
    device, dtype = layer.a.device, layer.a.dtype
    x = torch.randn(tokens, layer.a.shape[2], generator=gen).to(device, dtype)
    index = rows_of(tokens, slots, seed).to(device)
    layer.rows.bind(index)
    got = layer(x).float().cpu()
    want = torch_lora.reference_update(x.cpu(), layer.a.cpu(), layer.bt.cpu(), index.cpu())
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    base_rows = (index == 0).cpu()
    if slots > 4:
        base_rows |= (index == 3).cpu()  # the cleared slot runs the base model
    assert torch.equal(got[base_rows], torch.zeros_like(got[base_rows]))


@pytest.mark.parametrize("tokens", [1, 5, 64, 77])
@pytest.mark.parametrize("slots", [2, 4, 9])
def test_torch_paths_match_the_reference(tokens: int, slots: int) -> None:
    layer = layer_with(slots, 8, 40, 24, torch.float32, torch.device("cpu"), seed=tokens + slots)
    check(layer, tokens, slots, seed=tokens, tol=1e-4)
    # The dense path (the one CUDA without Triton takes) on the same layer and rows.
    x = torch.randn(tokens, 40)
    index = rows_of(tokens, slots, tokens + 1)
    out = torch.zeros(tokens, 24)
    torch_lora.add_dense(out, x, layer.a, layer.bt, index)
    want = torch_lora.reference_update(x, layer.a, layer.bt, index)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)


def test_set_slot_refuses_what_does_not_fit() -> None:
    layer = LoraLinear(_Zero(6), RowAdapters(), in_features=4, out_features=6, slots=3,
                       max_rank=2, dtype=torch.float32, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="outside 1..2"):
        layer.set_slot(3, torch.zeros(1, 4), torch.zeros(6, 1))
    with pytest.raises(ValueError, match="outside"):
        layer.set_slot(0, torch.zeros(1, 4), torch.zeros(6, 1))
    with pytest.raises(ValueError, match="rank 3 exceeds"):
        layer.set_slot(1, torch.zeros(3, 4), torch.zeros(6, 3))
    with pytest.raises(ValueError, match="do not fit"):
        layer.set_slot(1, torch.zeros(2, 5), torch.zeros(6, 2))
    with pytest.raises(ValueError, match="both"):
        layer.set_slot(1, torch.zeros(2, 4), None)


def test_set_slot_rewrites_in_place() -> None:
    """A smaller rank after a larger one leaves no trace of the old one; the tensors keep their
    addresses (CUDA graphs captured over them stay valid)."""
    layer = LoraLinear(_Zero(6), RowAdapters(), in_features=4, out_features=6, slots=2,
                       max_rank=3, dtype=torch.float32, device=torch.device("cpu"))
    address = layer.a.data_ptr(), layer.bt.data_ptr()
    layer.set_slot(1, torch.ones(3, 4), torch.ones(6, 3))
    layer.set_slot(1, torch.full((1, 4), 2.0), torch.full((6, 1), 3.0))
    layer.rows.bind(torch.tensor([1, 0]))
    got = layer(torch.ones(2, 4))
    assert torch.equal(got, torch.tensor([[24.0] * 6, [0.0] * 6]))
    assert (layer.a.data_ptr(), layer.bt.data_ptr()) == address


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_fused_pieces_expand_from_their_own_columns(device: str) -> None:
    """A q|k|v-like layer of three pieces: each adapter's A rows and block-diagonal B columns of
    piece p land in the piece's own slot columns (capacity 3 x 6, adapters of rank 4 and 2, one
    without the middle piece), and the expand gives the reference: on the CPU from each
    piece's own contiguous B (`split`); on another device the one block-diagonal B is kept
    (checked for its layout only: the meta device computes nothing)."""
    if device == "meta":
        layer = LoraLinear(_Zero(40), RowAdapters(), in_features=16, out_features=40,
                           slots=3, max_rank=18, dtype=torch.float32,
                           device=torch.device("meta"), pieces=(24, 8, 8))
        assert not layer.split and layer.bt.shape == (3, 18, 40) and len(layer.b_pieces) == 1
        return
    gen = torch.Generator().manual_seed(7)
    pieces, k = (24, 8, 8), 16
    layer = LoraLinear(_Zero(40), RowAdapters(), in_features=k, out_features=40, slots=3,
                       max_rank=18, dtype=torch.float32, device=torch.device("cpu"),
                       pieces=pieces)
    for slot, r, skip in ((1, 4, None), (2, 2, 1)):
        a = torch.randn(3 * r, k, generator=gen)
        b = torch.zeros(40, 3 * r)
        start = 0
        for p, size in enumerate(pieces):
            if p != skip:
                b[start:start + size, p * r:(p + 1) * r] = torch.randn(size, r, generator=gen)
            start += size
        layer.set_slot(slot, a, b)
        assert torch.equal(layer.a[slot, 6:6 + r], a[r:2 * r])  # piece 1 at its columns
        assert torch.equal(layer.a[slot, r:6], torch.zeros(6 - r, k))
    assert layer.split and [p.shape for p in layer.b_pieces] == [(3, 6, 24), (3, 6, 8),
                                                                 (3, 6, 8)]
    check(layer, 30, 3, seed=3, tol=1e-4)
    with pytest.raises(ValueError, match="multiple of 3"):
        layer.set_slot(1, torch.zeros(4, k), torch.zeros(40, 4))


@pytest.mark.parametrize("index", [
    [0, 0, 0],  # every row on the base model: nothing added
    [4, 4, 0, 4],  # one slot, not the first: the range starts at it
    [5, 2, 5, 5, 2],  # slots 3 and 4 absent inside the range, no base row (no zero row)
    [0, 2, 5, 0, 5, 5, 1],  # uneven segments (padding) and base rows between them
])
def test_segmented_rows_in_any_slot_pattern(index: list[int]) -> None:
    """The segments span only the present slots' range (absent slots at either end cost
    nothing), pad uneven ones, and send each row's update back to its own row: padding rows'
    results are never read and base rows get the appended zero row."""
    layer = layer_with(6, 4, 12, 10, torch.float32, torch.device("cpu"), seed=len(index))
    layer.set_slot(3, torch.randn(4, 12), torch.randn(10, 4))  # refill the cleared slot
    rows = torch.tensor(index)
    seg = torch_lora.segments(rows, 6)
    present = sorted({s for s in index if s})
    assert seg.count == (present[-1] - present[0] + 1 if present else 0)
    x = torch.randn(len(index), 12)
    layer.rows.bind(rows)
    got = layer(x)
    want = torch_lora.reference_update(x, layer.a, layer.bt, rows)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pieces", [(10,), (6, 4)])
def test_rank_columns_past_the_ranks_in_use_are_skipped(pieces: tuple[int, ...]) -> None:
    """Adapters of rank 3 and 2 per piece in slots of capacity 8 per piece (runtime updates'
    default is --max-lora-rank 64): the CPU computes only the columns in use and still gives
    the reference, for a plain and a fused (split) layer."""
    gen = torch.Generator().manual_seed(11)
    count = len(pieces)
    layer = LoraLinear(_Zero(10), RowAdapters(), in_features=12, out_features=10, slots=4,
                       max_rank=8 * count, dtype=torch.float32, device=torch.device("cpu"),
                       pieces=pieces)
    for slot, r in ((1, 3), (2, 2)):
        layer.set_slot(slot, torch.randn(count * r, 12, generator=gen),
                       torch.randn(10, count * r, generator=gen))
    rows = torch.tensor([1, 0, 2, 2, 1, 3])
    x = torch.randn(6, 12, generator=gen)
    layer.rows.bind(rows)
    want = torch_lora.reference_update(x, layer.a, layer.bt, rows)
    torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)

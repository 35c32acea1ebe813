"""Token masks of constrained rows: llguidance's bitmask words to what sampling applies.

llguidance writes one bit per token (bit i of int32 word w: token 32 w + i allowed). Sampling
needs the banned tokens at -inf before anything else sees the logits. On the CPU a masked fill
by a [rows, vocab] bool is the slow way: torch's masked_fill_ and where run scalar loops there
(~6 ms for 64 x 128k, measured in bench/experiments/grammar.py's breakdown), while adding a float32 bias of
0 / -inf is vectorised (~1-2 ms). The bias comes from the words in one gather: each byte of the
words holds 8 tokens' bits, and a [256, 8] table holds the 8 biases of every byte value, so
index_select(table, bytes) writes the whole bias (multi-threaded and memory-bound, ~2 ms;
numpy's unpackbits and a multiply took ~6 ms alone and ~15 ms in the grammar thread, where they
fought the forward for the cores and held the GIL). It runs on the engine's thread right before
sampling, when the forward is over, into buffers reused every step. Adding 0.0 leaves every
finite logit as it was (-0.0 becomes +0.0, which no later operation can tell apart) and -inf +
x is -inf: the same scores as the masked fill for every finite logit (a NaN logit stays NaN,
where the fill made a banned one -inf: a model that emits NaN could then pick a banned token,
which its matcher refuses, ending the request with EOS as for any refused token). On an
accelerator the words travel (32x smaller than the bias) and are unpacked there into banned
tokens, where masked_fill_ is fast.

Rows in the same grammar state have the same mask (a batch of one schema often has many: every
row inside a free string, or between properties), and their bias need not be written once per
row: consecutive batch rows with equal words form a run, each run's bias is made once and added
to its rows by broadcasting (SharedBias), which writes no [rows, vocab] bias and reads one row of
it from the cache instead of the whole. Runs are taken when they are at most half the rows.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

NEG_INF = float("-inf")
# Scores in a batch's constrained rows below which their bias is made per row, runs or not
# (64 x 4k: the whole bias written and added in ~0.07 ms, about what finding the runs costs).
SHARED_FROM = 1 << 20


def byte_bias_table() -> torch.Tensor:
    """[256, 8] float32: row b is the bias of the 8 tokens whose bits byte b holds, bit i
    (little-endian, as in llguidance's words on a little-endian host) 0.0 when set, -inf when
    clear."""
    bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
    return torch.where(bits == 1, 0.0, NEG_INF).to(torch.float32)


class HostBias:
    """Bitmask words to the CPU's float32 bias, with the byte table and reused buffers.

    A fresh 32 MB bias each step would be mmapped and page-faulted (~2 ms at 64 x 128k), so the
    bias is written into a buffer kept from step to step: what `__call__` returns is only good
    until its next call, which is how sampling uses it (banned, then applied, on one thread).

    The one-row biases of runs of rows sharing a mask (`rows`) are kept by content for the next
    steps: a row stays in one grammar state for many tokens (inside a string or a number), so
    most steps find every run's bias already made (a hash and compare of 16 KB of words at a
    128k vocabulary, against ~0.2 ms to write a 512 KB bias row).
    """

    def __init__(self, kept_rows: int = 16) -> None:
        self.table = byte_bias_table()
        self.kept_rows = kept_rows
        self._kept: OrderedDict[tuple[int, bytes], torch.Tensor] = OrderedDict()
        self._index = torch.empty(0, dtype=torch.int32)
        self._bias = torch.empty(0, 8)

    def __call__(self, words: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[rows, vocab_size] float32 bias (0.0 allowed, -inf banned) of [rows, width] int32
        words; a view of this object's buffer."""
        rows, width = words.shape[0], (vocab_size + 7) // 8
        need = rows * width
        if self._index.numel() < need:
            self._index = torch.empty(need, dtype=torch.int32)
            self._bias = torch.empty(need, 8)
        index = self._index[:need]
        index.view(rows, width).copy_(words.view(torch.uint8)[:, :width])
        bias = self._bias[:need]
        torch.index_select(self.table, 0, index, out=bias)
        return bias.view(rows, width * 8)[:, :vocab_size]

    def rows(self, words: np.ndarray, vocab_size: int) -> tuple[torch.Tensor, ...]:
        """One [vocab_size] bias per row of [rows, width] int32 `words`, each its own tensor,
        made once per distinct mask among the last `kept_rows` used."""
        out = []
        for row in words:
            key = (vocab_size, row.tobytes())
            bias = self._kept.get(key)
            if bias is None:
                # Made in the per-row buffer like any bias, then kept in a tensor of its own.
                bias = self(torch.from_numpy(row[None]), vocab_size)[0].clone()
                self._kept[key] = bias
                if len(self._kept) > self.kept_rows:
                    self._kept.popitem(last=False)
            else:
                self._kept.move_to_end(key)
            out.append(bias)
        return tuple(out)


@dataclass(frozen=True, slots=True)
class SharedBias:
    """The CPU's bias of runs of consecutive batch rows that share one mask: bias[k] ([vocab]
    float32, 0.0 allowed, -inf banned) belongs to batch rows starts[k] .. starts[k] + counts[k]
    - 1. Applying it is one broadcast add per run."""

    bias: tuple[torch.Tensor, ...]
    starts: tuple[int, ...]
    counts: tuple[int, ...]

    def apply(self, scores: torch.Tensor, lo: int = 0, hi: int | None = None) -> None:
        """Adds each run's bias to its rows of `scores` (the whole batch's), or only to those
        among batch rows lo .. hi - 1."""
        end = scores.shape[0] if hi is None else hi
        for bias, start, count in zip(self.bias, self.starts, self.counts, strict=True):
            first, last = max(start, lo), min(start + count, end)
            if first < last:
                scores[first:last].add_(bias)


def host_masks(
    host: HostBias,
    words: torch.Tensor,
    vocab_size: int,
    rows: Sequence[int],
    shared_from: int = SHARED_FROM,
) -> torch.Tensor | SharedBias:
    """What sampling adds for the words of the constrained batch rows `rows` (in order): a
    SharedBias when runs of equal masks in consecutive rows make it at most half as many
    biases as rows, else the [len(rows), vocab_size] bias (always below `shared_from` scores,
    where finding the runs costs more than writing and adding every row's bias)."""
    if len(rows) * vocab_size < shared_from:
        return host(words, vocab_size)
    flat = words.numpy()  # numpy's compare of 64 x 4k words is ~4x faster than torch's
    same = (flat[1:] == flat[:-1]).all(axis=1).tolist()
    firsts = [0] + [
        j + 1 for j, equal in enumerate(same) if not (equal and rows[j + 1] == rows[j] + 1)
    ]
    if len(firsts) > len(rows) // 2:
        return host(words, vocab_size)
    counts = [b - a for a, b in zip(firsts, [*firsts[1:], len(rows)], strict=True)]
    return SharedBias(
        host.rows(flat[firsts], vocab_size), tuple(rows[j] for j in firsts), tuple(counts)
    )


def unpack_with_torch(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bitmask words to [rows, vocab_size] bool, True where banned, on the words' device."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1
    return (bits == 0).flatten(1)[:, :vocab_size]

"""The greedy choice of a batch with grammar masks, a few rows at a time, on the CPU.

At a large vocabulary a batch's logits are tens of MB (64 x 128k float32: 32 MB), and a
constrained batch makes three passes over them after the forward: the masks' bias added, the
argmax, the log-softmax. One after the other, each pass reads back from memory what the one
before wrote. Done a block of rows at a time (about a core's L2 cache: 4 rows of 128k), the
argmax and the log-softmax find the block's rows still in cache: 0.9 ms a step less at 64 x 128k
(7.5 -> 6.6 ms, alternated medians of 40). Unconstrained batches make no add pass and are not
blocked (blocking them measured 0.1-0.4 ms slower); nor are batches below BLOCKED_FROM scores,
whose logits stay in cache anyway, where the extra ops per block would only cost.
"""

from __future__ import annotations

from bisect import bisect_left

import torch

from pytgi_shard.sample.argmax import first_max
from pytgi_shard.structured_output.masks import SharedBias

# Scores in a batch from which the choice runs in blocks (64 x 128k is 2^23).
BLOCKED_FROM = 1 << 22
# Bytes of float32 scores in a block: a core's L2 on the machines measured (2 MB).
BLOCK_BYTES = 1 << 21


def block_rows(scores: torch.Tensor) -> int | None:
    """Rows per block for this batch's choice, or None when it should not be blocked."""
    if scores.device.type != "cpu" or scores.numel() < BLOCKED_FROM or not scores.is_contiguous():
        return None
    return rows_per_block(scores)


def rows_per_block(scores: torch.Tensor) -> int:
    """How many of `scores`' rows make a block of about BLOCK_BYTES (at least one)."""
    return max(1, BLOCK_BYTES // (scores.shape[-1] * scores.element_size()))


def blocked_greedy(
    scores: torch.Tensor,
    rows: torch.Tensor | None,
    masks: torch.Tensor | SharedBias,
    block: int,
) -> torch.Tensor:
    """[batch] argmax ids of `scores` after the masks of the constrained `rows` (None: all rows;
    masks as sampling.ban_tokens takes them on the CPU: a float32 bias or a SharedBias), with
    `scores` turned into their log-softmax in place: the same as banning, first_max and
    log_softmax over the whole batch, a block of `block` rows at a time."""
    if isinstance(masks, torch.Tensor) and masks.dtype == torch.bool:
        raise ValueError("blocked_greedy takes the CPU's float32 bias, not bool masks")
    batch = scores.shape[0]
    listed = rows.tolist() if rows is not None else None
    ids = torch.empty(batch, dtype=torch.long)
    for lo in range(0, batch, block):
        hi = min(lo + block, batch)
        part = scores[lo:hi]
        if isinstance(masks, SharedBias):
            masks.apply(scores, lo, hi)
        else:
            _add_bias(scores, listed, masks, lo, hi)
        ids[lo:hi] = first_max(part)
        torch.log_softmax(part, dim=-1, out=part)
    return ids


def _add_bias(
    scores: torch.Tensor, rows: list[int] | None, bias: torch.Tensor, lo: int, hi: int
) -> None:
    """Adds the bias of the constrained rows among batch rows lo .. hi - 1 (`rows` ascending,
    as a batch lists its constrained rows; bias[j] is rows[j]'s)."""
    if rows is None:
        scores[lo:hi].add_(bias[lo:hi])
        return
    first, last = bisect_left(rows, lo), bisect_left(rows, hi)
    if first == last:
        return
    if rows[last - 1] - rows[first] == last - 1 - first:  # consecutive: one slice
        scores[rows[first] : rows[last - 1] + 1].add_(bias[first:last])
        return
    index = torch.tensor(rows[first:last])
    scores.index_add_(0, index, bias[first:last])

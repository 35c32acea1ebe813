"""One token per row drawn from a batch's logprobs with one random number per row: the CPU's
sampling.

argmax(p / E) with E ~ Exponential(1) per token (how accelerators sample here: vectorised, no
host sync) needs a random number per vocabulary entry, and a CPU generator makes them one at a
time: 2.2 ms for one 128k row, 140 ms a step for 64 sampling rows, when the bench model's
forward takes 31 ms. Inverse-transform sampling needs one per row: u ~ U[0, 1), and the token
where the running sum of the probabilities passes u times their total. A running sum over the
whole row is sequential on the CPU (13.5 ms for 64 x 128k), so it runs on two levels: the sums
of chunks of CHUNK tokens (a vectorised reduction), their running sum, the chunk where the
target falls, then the running sum of that chunk's tokens alone, in float64 from the chunk sums
down.

A token of probability 0 (banned by a grammar, cut by top-k or top-p) is never chosen: the
choice is the first index whose running sum exceeds the target, which a zero cannot be the
first to do; where rounding leaves the target past the end of a row or chunk, the last one of
non-zero probability is taken instead (a logprob of -inf is a probability of exactly 0). NaN
probabilities (a model that emitted NaN) still give an index inside the vocabulary.
"""

from __future__ import annotations

import torch

from pytgi_shard.blocked_choice import rows_per_block

# Tokens per chunk: long enough for the chunk sums' vector loop, short enough that a row's
# chunk sums (2k at 128k) and one chunk are cheap to scan.
CHUNK = 64


def draw_from_logprobs(
    logprobs: torch.Tensor, rows: torch.Tensor | None, uniforms: torch.Tensor
) -> torch.Tensor:
    """[n] int64: for each of `rows` (n row indices of [batch, vocab] `logprobs`; None: every
    row; normalised, as log_softmax makes them: the chunk sums come from their softmax, the
    chosen chunk's weights from their exp, which agree only then) its token drawn from
    exp(logprobs[row]) by uniforms[i] in [0, 1) (float64, for the resolution a large
    vocabulary needs). No [n, vocab] tensor is made: the rows' probabilities are made a block
    of rows at a time into one buffer, summed by chunk there, and only the chosen chunk's
    CHUNK probabilities are made again."""
    batch, vocab = logprobs.shape
    count = batch if rows is None else rows.numel()
    # About a core's L2 at a time, in a buffer small enough for the allocator to reuse from
    # step to step without faulting pages in.
    per = rows_per_block(logprobs)
    buffer = torch.empty(min(per, count), vocab, dtype=logprobs.dtype, device=logprobs.device)
    sums = torch.empty(count, -(-vocab // CHUNK), dtype=logprobs.dtype, device=logprobs.device)
    for lo in range(0, count, per):
        hi = min(lo + per, count)
        part = buffer[: hi - lo]
        block = logprobs[lo:hi] if rows is None else logprobs.index_select(0, rows[lo:hi])
        # softmax of logprobs is their exp; its kernel takes the -inf of banned tokens in its
        # stride, where torch.exp falls to a slow path (64 x 128k, 99% -inf: 15.7 ms vs 4.6).
        torch.softmax(block, dim=-1, out=part)
        _chunk_sums(part, out=sums[lo:hi])
    chunk, remainder = _pick(sums.double(), uniforms.to(torch.float64))
    source = torch.arange(batch, device=logprobs.device) if rows is None else rows
    columns = chunk.unsqueeze(1) * CHUNK + torch.arange(CHUNK, device=logprobs.device)
    inside = columns < vocab
    chosen = logprobs[source.unsqueeze(1), columns.clamp(max=vocab - 1)]
    within, _ = _pick(chosen.double().exp() * inside, remainder, scaled=False)
    return chunk * CHUNK + within


def row_sums(values: torch.Tensor) -> torch.Tensor:
    """[rows, 1]: the sum of each row of [rows, n] `values`, in an order that depends on the row
    alone. torch's sum over a whole row splits it among threads when it is the only row (with
    more rows, each row is summed by one thread), so one request's sum would change with its
    batch; sums of CHUNK values (many outputs, each summed whole) then the sum of those (a
    vocabulary's 2k chunk sums, below torch's grain for splitting a reduction) do not."""
    sums = torch.empty(values.shape[0], -(-values.shape[1] // CHUNK), dtype=values.dtype,
                       device=values.device)
    _chunk_sums(values, out=sums)
    return sums.sum(dim=-1, keepdim=True)


def _chunk_sums(probs: torch.Tensor, out: torch.Tensor) -> None:
    """out[r, c]: the sum of probs[r] over tokens c * CHUNK .. (c + 1) * CHUNK - 1."""
    rows, vocab = probs.shape
    full = vocab // CHUNK
    torch.sum(probs[:, : full * CHUNK].reshape(rows, full, CHUNK), dim=-1, out=out[:, :full])
    if full * CHUNK < vocab:
        torch.sum(probs[:, full * CHUNK :], dim=-1, out=out[:, full])


def _pick(
    weights: torch.Tensor, targets: torch.Tensor, scaled: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of [rows, n] float64 `weights`: the first index whose running sum exceeds the
    row's target (targets times the row's total when `scaled`, else the target itself), never
    past the last non-zero weight; and how far into that index's weight the target lies."""
    running = weights.cumsum(dim=-1)
    if scaled:
        targets = targets * running[:, -1]
    index = torch.searchsorted(running, targets.unsqueeze(1), right=True).squeeze(1)
    positions = torch.arange(weights.shape[1], device=weights.device)
    last_positive = ((weights > 0) * positions).amax(dim=-1)
    index = torch.minimum(index, last_positive)
    before = running.gather(1, (index - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    return index, targets - torch.where(index > 0, before, 0.0)

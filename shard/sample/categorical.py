"""One token per row drawn from a batch's logprobs with 1 + CHUNK random numbers per row: the
CPU's sampling.

argmax(p / E) with E ~ Exponential(1) per token (how accelerators sample here: vectorised, no
host sync) needs a random number per vocabulary entry, and a CPU generator makes them one at a
time: 2.2 ms for one 128k row, 140 ms a step for 64 sampling rows, when the bench model's
forward takes 31 ms. So the draw runs on two levels. The chunk, by inverse transform: u ~ U[0, 1)
and the chunk of CHUNK tokens where the running sum of the chunk sums (a vectorised reduction,
then a running sum in float64 over 2k values at 128k) passes u times their total. The token in
it, by the race argmax(p / E) over its CHUNK tokens, from CHUNK more uniforms.

Why not inverse transform inside the chunk too (one uniform a row, as before): its token
depends on the running sum of every token before it, so a change of 1e-6 in the logits (the
CPU forward's rounding changes with the batch size: matmul blocking) moves every boundary
between tokens, and the chance that the uniform lands in a moved sliver grows with their
number: 2e-6 of noise on the logits moved 2.9e-4 of the draws at a 4k vocabulary, 2.8e-3 at
32k, 3.9e-3 at 128k: a seeded request left its solo run after ~3,000 tokens, or ~250.
Only the chunk boundaries are sensitive now (1/64 as many), and a race changes its winner
only when the two best p / E are within the noise: none of 20k, 8k and 512 such draws moved
(tests/unit/shard/sample/test_categorical.py).

A token of probability 0 (banned by a grammar, cut by top-k or top-p) is never chosen: the chunk
is the first whose running sum exceeds the target, which a zero-sum chunk cannot be the first to
do (where rounding leaves the target past the end, the last chunk of non-zero sum is taken), and
in the race a 0 never beats a positive p (a logprob of -inf is a probability of exactly 0). NaN
probabilities (a model that emitted NaN) still give an index inside the vocabulary.
"""

from __future__ import annotations

import torch

from pytgi_shard.sample.blocked_choice import rows_per_block

# Tokens per chunk: long enough for the chunk sums' vector loop, short enough that a row's
# chunk sums (2k at 128k) and one chunk are cheap to scan.
CHUNK = 64
# Uniforms a row draws per step: one for the chunk, one per token of the chunk's race.
DRAWS = 1 + CHUNK


def row_draws(generator: torch.Generator | None) -> torch.Tensor:
    """[DRAWS] float64 uniforms in [0, 1): one sampling row's random numbers for one token, from
    the generator of that token (shard/sample/token_draws.py)."""
    return torch.rand(DRAWS, dtype=torch.float64, generator=generator)


def draw_from_logprobs(
    logprobs: torch.Tensor, rows: torch.Tensor | None, uniforms: torch.Tensor
) -> torch.Tensor:
    """[n] int64: for each of `rows` (n row indices of [batch, vocab] `logprobs`; None: every
    row; normalised, as log_softmax makes them: the chunk sums come from their softmax, the
    chosen chunk's weights from their exp, which agree only then) its token drawn from
    exp(logprobs[row]) by uniforms[i] ([n, DRAWS] float64 in [0, 1), `row_draws`: the first
    picks the chunk, with the resolution a large vocabulary needs; the others race in it).
    No [n, vocab] tensor is made: the rows' probabilities are made a block of rows at a time
    into one buffer, summed by chunk there, and only the chosen chunk's CHUNK probabilities
    are made again."""
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
    uniforms = uniforms.to(torch.float64)
    chunk = _pick(sums.double(), uniforms[:, 0])
    source = torch.arange(batch, device=logprobs.device) if rows is None else rows
    columns = chunk.unsqueeze(1) * CHUNK + torch.arange(CHUNK, device=logprobs.device)
    inside = columns < vocab
    chosen = logprobs[source.unsqueeze(1), columns.clamp(max=vocab - 1)]
    return chunk * CHUNK + _race(chosen.double().exp() * inside, uniforms[:, 1:])


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


def _pick(weights: torch.Tensor, fractions: torch.Tensor) -> torch.Tensor:
    """Per row of [rows, n] float64 `weights`: the first index whose running sum exceeds the
    row's fraction of its total, never past the last non-zero weight."""
    running = weights.cumsum(dim=-1)
    targets = (fractions * running[:, -1]).unsqueeze(1)
    index = torch.searchsorted(running, targets, right=True).squeeze(1)
    positions = torch.arange(weights.shape[1], device=weights.device)
    last_positive = ((weights > 0) * positions).amax(dim=-1)
    return torch.minimum(index, last_positive)


def _race(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row of [rows, n] float64 `weights` (not normalised): argmax(w / E) with
    E = -log(1 - u) ~ Exponential(1), which is index i with probability w_i / sum(w). E is kept
    above 0 (u = 0), so a zero weight never beats a positive one."""
    exponential = torch.log1p(-uniforms).neg_().clamp_min_(torch.finfo(torch.float64).tiny)
    return (weights / exponential).argmax(dim=-1)

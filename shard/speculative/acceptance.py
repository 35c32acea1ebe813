"""Which drafted tokens a verification step keeps: the rule that makes speculation exact.

A verification forward gives, for each row, the target's distribution at the row's last token
and after each of its k drafts: k + 1 positions. The row keeps the longest prefix of drafts the
target agrees with and one more token from the target (the correction where a draft was
rejected, the bonus after the last draft when all were kept), so every step emits at least the
token the plain step would have.

- Greedy rows: a draft is kept while it is the target's argmax at its position; the emitted
  tokens are then token for token the greedy output without speculation (`verify_greedy`,
  over raw scores: `kept_count`'s rule for the argmax, vectorised).
- Any row, as the engine verifies (`kept_count`): the token of every position is chosen as
  the plain step would choose it there (penalties over the drafts before it, its grammar mask,
  the warpers, and for a sampling row the random numbers of that token's index:
  shard/sample/token_draws.py), and drafts are kept while they equal it. For a drafter that
  proposes with certainty (n-gram lookup, a greedy draft model) this is speculative sampling's
  rule itself (below, q one-hot: kept with probability p(d), a rejection distributed as p
  without d), with the coupling that gives a seeded request the tokens it gets without drafts.
- Sampling rows with a drafter that has a distribution q: speculative sampling (Leviathan et
  al. 2023, Chen et al. 2023), `verify_sampled`. Draft d at a position is kept with
  probability min(1, p(d) / q(d)), p the target's (warped) distribution; at the first
  rejection the token is drawn from max(0, p - q) renormalised. Each emitted token is then
  distributed exactly as the target alone would draw it (keeping more drafts than
  `kept_count` would, whose rule keeps d with probability p(d) only), but a seeded
  request's tokens then depend on what was drafted. With draft_probs None (q one-hot) a draft
  is kept with probability p(d) and a rejection draws from p without d. Not wired in: the
  n-gram drafter has no distribution.

Rows carry up to k drafts each (`lengths`); positions past a row's length are ignored. The
randomness comes in as tensors, drawn per request, so a seeded request draws the same numbers
whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pytgi_shard.sample.argmax import first_max
from pytgi_shard.sample.categorical import draw_from_logprobs


@dataclass(frozen=True, slots=True)
class Verdict:
    """A verification step's outcome per row."""

    # [rows] int64: drafts kept (0..length).
    accepted: torch.Tensor
    # [rows, k + 1] int64: the emitted tokens, the first accepted + 1 of each row (the kept
    # drafts, then the target's token); the rest is padding (-1).
    tokens: torch.Tensor


def kept_prefix(agrees: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[rows] int64: per row of [rows, k] bool `agrees`, how many leading positions within the
    row's length agree (a draft after a rejected one is never kept)."""
    k = agrees.shape[1]
    inside = torch.arange(k, device=agrees.device) < lengths.unsqueeze(1)
    return (agrees & inside).to(torch.int64).cumprod(dim=1).sum(dim=1)


def emitted(drafts: torch.Tensor, accepted: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """[rows, k + 1]: the kept drafts, then `last` ([rows]) at index `accepted`, then -1."""
    rows, k = drafts.shape
    out = torch.full((rows, k + 1), -1, dtype=torch.int64, device=drafts.device)
    keep = torch.arange(k, device=drafts.device) < accepted.unsqueeze(1)
    out[:, :k] = torch.where(keep, drafts.to(torch.int64), out[:, :k])
    out[torch.arange(rows, device=drafts.device), accepted] = last
    return out


def kept_count(chosen: Sequence[int], drafts: Sequence[int]) -> int:
    """How many of a row's `drafts` are kept, given the token chosen at each of its positions
    as the plain step chooses it there (`chosen`: the step's plain token, then the choice after
    each draft, position j given d_0 .. d_(j-1)): the leading drafts equal to their position's
    choice. The row then emits chosen[0 .. kept]: every emitted token is the one its position
    chooses after the tokens actually emitted before it, exact for any choice rule. For a
    sampling rule this is speculative sampling with a drafter that proposes with certainty
    (q one-hot): the draft is kept with probability p(d), and a rejection's token is
    distributed as p without d, renormalised (`verify_sampled` with draft_probs None, drawn
    the other way); drawing each position with its own token's random numbers
    (shard/sample/token_draws.py) makes the tokens those of the plain run."""
    kept = 0
    for token, draft in zip(chosen, drafts, strict=False):
        if token != draft:
            break
        kept += 1
    return kept


def verify_greedy(scores: torch.Tensor, drafts: torch.Tensor, lengths: torch.Tensor) -> Verdict:
    """Greedy rows: [rows, k + 1, vocab] `scores` (any monotone transform of the warped
    logits), [rows, k] `drafts`, [rows] `lengths`."""
    rows, positions, vocab = scores.shape
    best = first_max(scores.reshape(rows * positions, vocab)).view(rows, positions)
    accepted = kept_prefix(best[:, :-1] == drafts, lengths)
    last = best.gather(1, accepted.unsqueeze(1)).squeeze(1)
    return Verdict(accepted, emitted(drafts, accepted, last))


def verify_sampled(
    logprobs: torch.Tensor,
    drafts: torch.Tensor,
    lengths: torch.Tensor,
    coins: torch.Tensor,
    draws: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> Verdict:
    """Sampling rows: [rows, k + 1, vocab] normalised `logprobs` of the warped target,
    [rows, k] `drafts`, [rows] `lengths`, [rows, k] uniforms `coins` (one per draft), [rows,
    DRAWS] uniforms `draws` (categorical.row_draws: the correction or bonus token), and the
    drafter's [rows, k, vocab] probabilities (None: drafts proposed with certainty)."""
    drafts = drafts.clamp(min=0)  # padding past a row's length may be -1: any token id will do
    p_draft = logprobs[:, :-1].gather(2, drafts.unsqueeze(2)).squeeze(2).exp()
    q_draft = _draft_mass(draft_probs, drafts)
    # u < p / q, written without the division (q > 0 where the drafter proposed d).
    accepted = kept_prefix(coins.to(p_draft.dtype) * q_draft < p_draft, lengths)
    rows = torch.arange(drafts.shape[0], device=drafts.device)
    target = logprobs[rows, accepted]
    rejected = accepted < lengths
    residual = _residual(target, drafts, accepted, rejected, draft_probs)
    last = draw_from_logprobs(residual, None, draws)
    return Verdict(accepted, emitted(drafts, accepted, last))


def _draft_mass(draft_probs: torch.Tensor | None, drafts: torch.Tensor) -> torch.Tensor:
    """q(d) per drafted position: 1 for a drafter without a distribution."""
    if draft_probs is None:
        return torch.ones(drafts.shape, dtype=torch.float32, device=drafts.device)
    return draft_probs.gather(2, drafts.unsqueeze(2)).squeeze(2)


def _residual(
    target: torch.Tensor,
    drafts: torch.Tensor,
    accepted: torch.Tensor,
    rejected: torch.Tensor,
    draft_probs: torch.Tensor | None,
) -> torch.Tensor:
    """[rows, vocab] logprobs the last token is drawn from: the target's own where every draft
    was kept (the bonus token), max(0, p - q) renormalised where one was rejected."""
    if not bool(rejected.any()):
        return target
    rows = torch.arange(drafts.shape[0], device=drafts.device)
    at = accepted.clamp(max=drafts.shape[1] - 1)
    probs = target.exp()
    if draft_probs is None:
        # Only rejected rows read the result (below), so every row's draft is removed.
        probs[rows, drafts[rows, at]] = 0.0
        less = probs
    else:
        less = (probs - draft_probs[rows, at].to(probs.dtype)).clamp_(min=0.0)
    total = less.sum(dim=1, keepdim=True)
    # Where rounding left nothing (p == q up to float error: a rejection then has probability
    # ~0), the target itself is the distribution.
    usable = rejected.unsqueeze(1) & (total > 0)
    corrected = torch.log(less / total.clamp(min=torch.finfo(less.dtype).tiny))
    return torch.where(usable, corrected, target)

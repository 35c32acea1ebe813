"""Top-p and typical-p over a batch's top-k candidates instead of a sort of the whole vocabulary.

The plain warpers (sampling.py) sort every row of [batch, vocab]: on a 128k vocabulary the sort
dominates a sampling step. When every row of the batch has a top-k, a row's tokens outside its
top-k are already -inf, and these functions give the plain warpers' result bit for bit while
sorting only the [batch, K] candidates:

- every value the plain warper reduces over (softmax, cumsum) is laid out in a full [batch, vocab]
  row exactly as the plain one lays it out after its sort, so the reductions see the same numbers
  in the same places: the ascending scores end with the candidates (all -inf before them), the
  tokens in order of typical-p's gap start with them (all -inf after them);
- both sorts are stable, so tied values keep their token-id order in both;
- the candidates' own -inf fillers may be other -inf tokens than the plain sort puts there, which
  only re-masks tokens that are -inf already.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def top_candidates(scores: torch.Tensor, top_k_ids: torch.Tensor) -> torch.Tensor:
    """[batch, K] ids holding every token of `scores` that is not -inf, in id order.

    `top_k_ids` are the ids of the top-k taken for the batch's largest k; a row that kept more
    (ties at its k-th value) widens the set. Sizing it reads one count from the device: the only
    host sync of a sampling step, and only of one whose rows all have a top-k with a top-p or
    typical-p somewhere.
    """
    kept = int((scores != NEG_INF).sum(dim=-1).max())
    if kept > top_k_ids.shape[1]:
        top_k_ids = torch.topk(scores, kept, dim=-1).indices
    return top_k_ids.sort(dim=-1).values


def top_p_over(scores: torch.Tensor, candidates: torch.Tensor, top_p: torch.Tensor) -> None:
    """sampling._top_p in place, given `top_candidates(scores, ...)`."""
    vocab, k = scores.shape[1], candidates.shape[1]
    ordered, order = scores.gather(1, candidates).sort(dim=-1, stable=True)
    ascending = torch.full_like(scores, NEG_INF)
    ascending[:, vocab - k :] = ordered
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)[:, vocab - k :]
    remove = cumulative <= 1 - top_p
    # The most likely token always stays.
    remove[:, -1] = False
    scores.scatter_(1, candidates.gather(1, order), ordered.masked_fill(remove, NEG_INF))


def typical_p_over(scores: torch.Tensor, candidates: torch.Tensor, mass: torch.Tensor) -> None:
    """sampling._typical_p in place, given `top_candidates(scores, ...)`."""
    vocab, k = scores.shape[1], candidates.shape[1]
    logp = torch.log_softmax(scores, dim=-1)
    entropy = -(logp * logp.exp()).nansum(dim=-1, keepdim=True)
    # -inf tokens have an infinite gap: they sort after every finite one.
    sorted_gap, order = (-logp.gather(1, candidates) - entropy).abs().sort(dim=-1, stable=True)
    tokens = candidates.gather(1, order)
    by_gap = torch.full_like(scores, NEG_INF)
    by_gap[:, :k] = scores.gather(1, tokens)
    cumulative = by_gap.softmax(dim=-1).cumsum(dim=-1)
    last = (cumulative < mass).sum(dim=1, keepdim=True).clamp(max=vocab - 1)
    # Past the candidates every gap is infinite, and no candidate's gap exceeds the last
    # candidate's: that one is as good a threshold there.
    remove = sorted_gap > sorted_gap.gather(1, last.clamp(max=k - 1))
    scores.scatter_(1, tokens, by_gap[:, :k].masked_fill(remove, NEG_INF))

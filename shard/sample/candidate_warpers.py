"""Top-p and typical-p over a batch's top-k candidates instead of a sort of the whole vocabulary.

The plain warpers (chooser.py) sort every row of [batch, vocab]: on a 128k vocabulary the sort
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

Both forms share the rules below: a row whose value is neutral (1.0) keeps every token, and
typical-p's entropy is summed in an order of the row's own.
"""

from __future__ import annotations

import torch

from pytgi_shard.sample.categorical import row_sums

NEG_INF = float("-inf")
INF = float("inf")


def removable_mass(top_p: torch.Tensor) -> torch.Tensor:
    """[rows, 1]: how much of a row's least likely mass top-p removes, 1 - top_p; -inf for a
    row whose top_p is 1.0, which removes nothing (in float32, 1 - 1.0 = 0 would still match
    the running mass over the row's tokens whose probability underflows to 0)."""
    return (1 - top_p).masked_fill(top_p >= 1, NEG_INF)


def largest_kept_gap(gap: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """[rows, 1]: the largest surprise gap typical-p keeps, given `gap` (the gap at which the
    row's running mass reaches `mass`); +inf for a row whose typical_p is 1.0 (a float32
    running mass reaches 1.0 before the end of a row, and the tokens after it would go)."""
    return gap.masked_fill(mass >= 1, INF)


def entropy(logp: torch.Tensor) -> torch.Tensor:
    """[rows, 1]: -sum(p log p) of each row of normalised logprobs (-inf tokens count 0), with
    the same bits whatever rows are beside it (categorical.row_sums): a plain sum over a
    single row is split among threads and over several is not (152k tokens, 2 threads)."""
    return -row_sums((logp * logp.exp()).nan_to_num_(nan=0.0))


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
    """chooser._top_p in place, given `top_candidates(scores, ...)`."""
    vocab, k = scores.shape[1], candidates.shape[1]
    ordered, order = scores.gather(1, candidates).sort(dim=-1, stable=True)
    ascending = torch.full_like(scores, NEG_INF)
    ascending[:, vocab - k :] = ordered
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)[:, vocab - k :]
    remove = cumulative <= removable_mass(top_p)
    # The most likely token always stays.
    remove[:, -1] = False
    scores.scatter_(1, candidates.gather(1, order), ordered.masked_fill(remove, NEG_INF))


def typical_p_over(scores: torch.Tensor, candidates: torch.Tensor, mass: torch.Tensor) -> None:
    """chooser._typical_p in place, given `top_candidates(scores, ...)`."""
    vocab, k = scores.shape[1], candidates.shape[1]
    logp = torch.log_softmax(scores, dim=-1)
    # -inf tokens have an infinite gap: they sort after every finite one.
    gap = (-logp.gather(1, candidates) - entropy(logp)).abs()
    sorted_gap, order = gap.sort(dim=-1, stable=True)
    tokens = candidates.gather(1, order)
    by_gap = torch.full_like(scores, NEG_INF)
    by_gap[:, :k] = scores.gather(1, tokens)
    cumulative = by_gap.softmax(dim=-1).cumsum(dim=-1)
    last = (cumulative < mass).sum(dim=1, keepdim=True).clamp(max=vocab - 1)
    # Past the candidates every gap is infinite, and no candidate's gap exceeds the last
    # candidate's: that one is as good a threshold there.
    remove = sorted_gap > largest_kept_gap(sorted_gap.gather(1, last.clamp(max=k - 1)), mass)
    scores.scatter_(1, tokens, by_gap[:, :k].masked_fill(remove, NEG_INF))

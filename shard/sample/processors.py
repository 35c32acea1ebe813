"""The element-wise logits processors over a batch (repetition and frequency penalties,
temperature), and what keeps their scores finite.

Each leaves a row whose value is neutral (1.0, 0.0, 1.0) as it is, bit for bit: x / 1, x * 1
and x - 0 are x. A non-neutral one can push a finite logit past float32's range: CTRL divides a
positive logit by the penalty (`repetition_penalty: 1e-40` reaches +inf from any logit above
0.034), a temperature divides every logit. An infinite score makes its whole row NaN in the
softmaxes after it (inf - inf), a row the argmax then read as token 0, step after step. So:

- a batch with penalties bounds its scores at float32's largest value after the penalties and
  the temperature (`saturate`): the overflowing tokens tie at the top, the row stays a
  distribution;
- a temperature below SHIFTED_BELOW divides the row's distance to its maximum, never above 0,
  so it tends to the argmax as it shrinks; at or above it, an unpenalized logit would have to
  exceed 3.4e38 * SHIFTED_BELOW to overflow, and the temperature keeps costing one pass.
"""

from __future__ import annotations

import torch

FLOAT32_MAX = torch.finfo(torch.float32).max
# Temperatures below this are applied to the scores minus the row's maximum (two more passes
# over the batch, paid only by batches that have one: the router sends none below 1e-5).
SHIFTED_BELOW = 1e-3


def penalize(
    scores: torch.Tensor,
    history: torch.Tensor,
    lengths: torch.Tensor,
    repetition: torch.Tensor | None,
    frequency: torch.Tensor | None,
) -> None:
    """Applies the [batch, 1] penalties (None: neutral in every row) to `scores` in place."""
    counts = token_counts(history, lengths, scores.shape[-1])
    if repetition is not None:
        # CTRL: push every token seen so far away from being chosen, whatever its sign.
        penalized = torch.where(scores > 0, scores / repetition, scores * repetition)
        scores.copy_(torch.where(counts > 0, penalized, scores))
    if frequency is not None:
        # Length-normalised counts, as TGI: the penalty does not grow with the context.
        scores.sub_(frequency * counts / lengths.unsqueeze(1).to(counts.dtype))


def shifted_rows(temperatures: list[float], device: torch.device) -> torch.Tensor | None:
    """[batch, 1] bool: the rows whose temperature is below SHIFTED_BELOW; None if none is."""
    shifted = [t < SHIFTED_BELOW for t in temperatures]
    if not any(shifted):
        return None
    return torch.tensor(shifted, device=device).unsqueeze(1)


def divide_by_temperature(
    scores: torch.Tensor, temperature: torch.Tensor, shifted: torch.Tensor | None
) -> None:
    """scores / temperature in place; the `shifted` rows (shifted_rows) minus their maximum
    first (a penalty's +inf counting as float32's largest value), the others minus 0."""
    if shifted is not None:
        maximum = scores.amax(dim=-1, keepdim=True).clamp_(max=FLOAT32_MAX)
        scores.sub_(maximum.masked_fill_(~shifted, 0.0))
    scores.div_(temperature)


def saturate(scores: torch.Tensor) -> None:
    """Bounds `scores` to float32's finite range in place, after the processors and before the
    grammar's bans (whose -inf must stay -inf). Finite scores are left as they are."""
    scores.clamp_(-FLOAT32_MAX, FLOAT32_MAX)


def token_counts(history: torch.Tensor, lengths: torch.Tensor, vocab: int) -> torch.Tensor:
    """[batch, vocab] float32: how often each token occurs in each row's first `lengths` ids."""
    width = history.shape[1]
    beyond = torch.arange(width, device=history.device).unsqueeze(0) >= lengths.unsqueeze(1)
    # Ids past a row's length go to an extra column that is dropped, so padding counts nowhere.
    ids = history.masked_fill(beyond, vocab)
    counts = torch.zeros(history.shape[0], vocab + 1, dtype=torch.float32, device=history.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]

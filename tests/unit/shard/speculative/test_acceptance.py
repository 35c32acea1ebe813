"""Verification is exact: greedy rows emit the plain greedy tokens, sampling rows draw each
token from the target's distribution (chi-square, many seeds), and a wrong rule is caught."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pytgi_shard.sample.categorical import DRAWS
from pytgi_shard.speculative.acceptance import verify_greedy, verify_sampled

VOCAB = 6
TRIALS = 40_000
# Chi-square critical value for VOCAB - 1 = 5 degrees of freedom at significance 1e-3.
CHI2_CRITICAL = 20.515


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(tokens, minlength=VOCAB).double()
    expected = probs.double() * tokens.numel()
    return float(((observed - expected) ** 2 / expected).sum())


def greedy_loop(scores: torch.Tensor, drafts: list[int], length: int) -> list[int]:
    """The definition: keep drafts while each is the argmax, then the argmax."""
    out = []
    for j in range(length):
        best = int(scores[j].argmax())
        if best != drafts[j]:
            return out + [best]
        out.append(best)
    return out + [int(scores[length].argmax())]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 5), st.integers(0, 4))
def test_greedy_rows_emit_the_plain_greedy_tokens(seed: int, rows: int, k: int) -> None:
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, k + 1, VOCAB, generator=g)
    # Drafts right about half the time, so every acceptance length occurs.
    best = scores.argmax(dim=2)[:, :k]
    noise = torch.randint(0, VOCAB, (rows, k), generator=g)
    drafts = torch.where(torch.rand(rows, k, generator=g) < 0.6, best, noise)
    lengths = torch.randint(0, k + 1, (rows,), generator=g)
    verdict = verify_greedy(scores, drafts, lengths)
    for r in range(rows):
        want = greedy_loop(scores[r], drafts[r].tolist(), int(lengths[r]))
        got = verdict.tokens[r, : int(verdict.accepted[r]) + 1].tolist()
        assert got == want
        assert (verdict.tokens[r, len(want):] == -1).all()


def target(seed: int) -> torch.Tensor:
    """[2, VOCAB] target distributions of two positions, the first peaked on token 2 so that
    its draft is often kept and the second position is well sampled."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, VOCAB, generator=g)
    logits[0, 2] += 3.0
    return torch.softmax(logits, dim=1)


def run(probs: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None,
        coins: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """TRIALS independent verifications of one draft (k = 1), each with its own randomness."""
    g = torch.Generator().manual_seed(1234)
    logprobs = probs.log().expand(TRIALS, 2, VOCAB)
    lengths = torch.ones(TRIALS, dtype=torch.int64)
    if coins is None:
        coins = torch.rand(TRIALS, 1, dtype=torch.float64, generator=g)
    draws = torch.rand(TRIALS, DRAWS, dtype=torch.float64, generator=g)
    verdict = verify_sampled(logprobs, drafts, lengths, coins, draws, draft_probs)
    return verdict.tokens, verdict.accepted


def test_a_certain_draft_leaves_both_tokens_distributed_as_the_target() -> None:
    probs = target(0)
    drafts = torch.full((TRIALS, 1), 2)
    tokens, accepted = run(probs, drafts, None)
    assert chi_square(tokens[:, 0], probs[0]) < CHI2_CRITICAL
    # A certain draft is kept with probability p(d): a binomial count, within 5 sigma.
    kept, p = int(accepted.sum()), float(probs[0, 2])
    assert abs(kept - TRIALS * p) < 5 * (TRIALS * p * (1 - p)) ** 0.5
    second = tokens[accepted == 1, 1]
    assert chi_square(second, probs[1]) < CHI2_CRITICAL


def test_a_drafted_distribution_leaves_both_tokens_distributed_as_the_target() -> None:
    probs = target(1)
    g = torch.Generator().manual_seed(99)
    q = torch.softmax(torch.randn(VOCAB, generator=g) * 2, dim=0)
    drafts = torch.multinomial(q, TRIALS, replacement=True, generator=g).unsqueeze(1)
    draft_probs = q.expand(TRIALS, 1, VOCAB)
    tokens, accepted = run(probs, drafts, draft_probs)
    assert chi_square(tokens[:, 0], probs[0]) < CHI2_CRITICAL
    # The second token exists only after a kept draft and is the target's own draw there.
    assert chi_square(tokens[accepted == 1, 1], probs[1]) < CHI2_CRITICAL


def test_always_accepting_fails_the_same_check() -> None:
    """The check above can fail: coins of 0 keep every draft (u < p / q always)."""
    probs = target(0)
    drafts = torch.full((TRIALS, 1), 2)
    tokens, _ = run(probs, drafts, None, coins=torch.zeros(TRIALS, 1, dtype=torch.float64))
    assert chi_square(tokens[:, 0], probs[0]) > 100 * CHI2_CRITICAL


def test_a_rejected_certain_draft_is_never_drawn_again() -> None:
    probs = target(2)
    tokens, accepted = run(probs, torch.full((TRIALS, 1), 2), None)
    assert not (tokens[accepted == 0, 0] == 2).any()


def test_rows_without_drafts_draw_from_the_first_position() -> None:
    probs = target(3)
    g = torch.Generator().manual_seed(5)
    logprobs = probs.log().expand(TRIALS, 2, VOCAB)
    draws = torch.rand(TRIALS, DRAWS, dtype=torch.float64, generator=g)
    coins = torch.rand(TRIALS, 1, dtype=torch.float64, generator=g)
    verdict = verify_sampled(logprobs, torch.full((TRIALS, 1), -1), torch.zeros(TRIALS,
                             dtype=torch.int64), coins, draws)
    assert (verdict.accepted == 0).all()
    assert chi_square(verdict.tokens[:, 0], probs[0]) < CHI2_CRITICAL

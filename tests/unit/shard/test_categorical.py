"""The CPU's draw by inverse transform on two levels (shard/categorical.py) against the
one-level float64 reference: exactly the same token where the sums are exact, the right
frequencies, never a token of probability 0 (whatever the uniform, however the chunk sums
round), always an index inside the vocabulary."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pytgi_shard.categorical import CHUNK, draw_from_logprobs


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The draw from rows of probabilities, given as the sampler gives them: normalised
    logprobs."""
    return draw_from_logprobs(torch.log_softmax(probs.log(), dim=-1), None, uniforms)


def reference(probs: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-level draw from the normalised probs in float64, and whether each row's target
    lies clear of the running sums' boundaries (where float32 sums may decide otherwise)."""
    p = probs.double() / probs.double().sum(dim=-1, keepdim=True)
    running = p.cumsum(dim=-1)
    targets = (uniforms.double() * running[:, -1]).unsqueeze(1)
    clear = ((running - targets).abs() > 1e-6 * running[:, -1:]).all(dim=1)
    return torch.searchsorted(running, targets, right=True).squeeze(1), clear


@pytest.mark.parametrize("vocab", [1, 5, CHUNK, CHUNK + 1, 3 * CHUNK - 7, 4 * CHUNK])
def test_the_same_token_as_the_one_level_reference(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    probs = torch.randint(0, 4, (3, vocab), generator=g).float() / 1024
    probs[:, 0] += 1 / 1024  # no row all zero
    grid = torch.linspace(0, 1 - 1e-9, 257, dtype=torch.float64)
    compared = 0
    for u in grid:
        uniforms = torch.full((3,), float(u), dtype=torch.float64)
        expected, clear = reference(probs, uniforms)
        assert torch.equal(draw(probs, uniforms)[clear], expected[clear])
        compared += int(clear.sum())
    assert compared > 3 * 257 // 2


@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4], [4, 0, 2], [3]])
def test_a_subset_of_rows_draws_as_those_rows_alone(rows: list[int]) -> None:
    """Blocks of rows (4 per block at this vocabulary) and row subsets change nothing."""
    vocab = 1 << 17
    g = torch.Generator().manual_seed(1)
    logprobs = torch.log_softmax(torch.randn(5, vocab, generator=g) * 3, dim=-1)
    uniforms = torch.rand(5, dtype=torch.float64, generator=g)
    every = draw_from_logprobs(logprobs, None, uniforms)
    index = torch.tensor(rows)
    some = draw_from_logprobs(logprobs, index, uniforms[index])
    assert torch.equal(some, every[index])
    alone = [draw_from_logprobs(logprobs[r : r + 1], None, uniforms[r : r + 1]) for r in rows]
    assert torch.equal(some, torch.cat(alone))


def test_frequencies_follow_the_probabilities_across_chunks() -> None:
    vocab = 3 * CHUNK + 5
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(1, vocab, generator=g) * 2, dim=-1)
    draws = 40_000
    uniforms = torch.rand(draws, dtype=torch.float64, generator=g)
    ids = draw(probs.expand(draws, vocab), uniforms)
    freq = torch.bincount(ids, minlength=vocab).double() / draws
    total_variation = 0.5 * (freq - probs[0].double()).abs().sum()
    assert total_variation < 0.03


@settings(max_examples=200, deadline=None)
@given(
    vocab=st.integers(1, 3 * CHUNK + 3),
    seed=st.integers(0, 2**31 - 1),
    zeros=st.floats(0.0, 0.99),
    u=st.one_of(st.just(0.0), st.just(1 - 2**-53), st.floats(0.0, 1 - 2**-53)),
)
def test_a_token_of_probability_zero_is_never_drawn(
    vocab: int, seed: int, zeros: float, u: float
) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, vocab, generator=g) * 8
    banned = torch.rand(2, vocab, generator=g) < zeros
    banned[:, int(torch.randint(0, vocab, (1,), generator=g))] = False
    probs = torch.softmax(logits.masked_fill(banned, -math.inf), dim=-1)
    ids = draw(probs, torch.tensor([u, 1 - u], dtype=torch.float64).clamp(max=1 - 2**-53))
    assert ((ids >= 0) & (ids < vocab)).all()
    assert (probs.gather(1, ids.unsqueeze(1)) > 0).all()


def test_nan_probabilities_still_give_an_index_in_the_vocabulary() -> None:
    probs = torch.full((2, 2 * CHUNK + 3), math.nan)
    probs[1, :CHUNK] = 0.0
    ids = draw(probs, torch.tensor([0.5, 0.99], dtype=torch.float64))
    assert ((ids >= 0) & (ids < probs.shape[1])).all()

"""The CPU's two-level draw (shard/sample/categorical.py: the chunk by inverse transform, the token by
a race in it) against the one-level float64 inverse transform: exactly the same chunk where the
sums are exact, the right frequencies, never a token of probability 0 (whatever the uniforms,
however the chunk sums round), always an index inside the vocabulary, and a draw that a 1e-6
change of the logits (the CPU forward's rounding with another batch) rarely moves."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pytgi_shard.sample.categorical import CHUNK, DRAWS, draw_from_logprobs, row_draws


def draw(probs: torch.Tensor, uniforms: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """The draw from rows of probabilities, given as the sampler gives them (normalised
    logprobs), with `uniforms` [rows] picking the chunk and seeded ones racing in it."""
    race = torch.rand(len(uniforms), DRAWS - 1, dtype=torch.float64,
                      generator=torch.Generator().manual_seed(seed))
    every = torch.cat((uniforms.unsqueeze(1), race), dim=1)
    return draw_from_logprobs(torch.log_softmax(probs.log(), dim=-1), None, every)


def reference(probs: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-level draw from the normalised probs in float64, and whether each row's target
    lies clear of the running sums' boundaries (where float32 sums may decide otherwise)."""
    p = probs.double() / probs.double().sum(dim=-1, keepdim=True)
    running = p.cumsum(dim=-1)
    targets = (uniforms.double() * running[:, -1]).unsqueeze(1)
    clear = ((running - targets).abs() > 1e-6 * running[:, -1:]).all(dim=1)
    return torch.searchsorted(running, targets, right=True).squeeze(1), clear


@pytest.mark.parametrize("vocab", [1, 5, CHUNK, CHUNK + 1, 3 * CHUNK - 7, 4 * CHUNK])
def test_the_same_chunk_as_the_one_level_reference(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    probs = torch.randint(0, 4, (3, vocab), generator=g).float() / 1024
    probs[:, 0] += 1 / 1024  # no row all zero
    grid = torch.linspace(0, 1 - 1e-9, 257, dtype=torch.float64)
    compared = 0
    for u in grid:
        uniforms = torch.full((3,), float(u), dtype=torch.float64)
        expected, clear = reference(probs, uniforms)
        got = draw(probs, uniforms)
        assert torch.equal(got[clear] // CHUNK, expected[clear] // CHUNK)
        compared += int(clear.sum())
    assert compared > 3 * 257 // 2


@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4], [4, 0, 2], [3]])
def test_a_subset_of_rows_draws_as_those_rows_alone(rows: list[int]) -> None:
    """Blocks of rows (4 per block at this vocabulary) and row subsets change nothing."""
    vocab = 1 << 17
    g = torch.Generator().manual_seed(1)
    logprobs = torch.log_softmax(torch.randn(5, vocab, generator=g) * 3, dim=-1)
    uniforms = torch.stack([row_draws(g) for _ in range(5)])
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
    # The race's extremes too: every uniform 0 (E at its floor) or 1 - 2**-53.
    for race in (0.0, 1 - 2**-53):
        every = torch.full((2, DRAWS), race, dtype=torch.float64)
        every[:, 0] = torch.tensor([u, 1 - u]).clamp(max=1 - 2**-53)
        ids = draw_from_logprobs(torch.log_softmax(probs.log(), dim=-1), None, every)
        assert (probs.gather(1, ids.unsqueeze(1)) > 0).all()


def one_level(logprobs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse transform over the tokens themselves (the draw before), in float64."""
    running = logprobs.double().exp().cumsum(dim=-1)
    targets = (uniforms * running[:, -1]).unsqueeze(1)
    return torch.searchsorted(running, targets, right=True).squeeze(1)


def test_a_change_of_the_logits_in_their_last_bits_rarely_moves_the_draw() -> None:
    # The CPU forward's logits move by ~1e-6 with the batch size (matmul blocking): a seeded
    # request's draws should not. Inverse transform over the tokens moves one draw in ~3,000
    # at this vocabulary; the chunk-then-race draw, far fewer.
    g = torch.Generator().manual_seed(0)
    rows, vocab, moved, moved_before = 2048, 4096, 0, 0
    for _ in range(10):
        logits = torch.randn(rows, vocab, generator=g) * 3.3
        nudged = logits + torch.randn(rows, vocab, generator=g) * 2e-6
        a, b = torch.log_softmax(logits, dim=-1), torch.log_softmax(nudged, dim=-1)
        uniforms = torch.stack([row_draws(g) for _ in range(rows)])
        moved += int((draw_from_logprobs(a, None, uniforms) != draw_from_logprobs(b, None, uniforms)).sum())
        first = uniforms[:, 0]
        moved_before += int((one_level(a, first) != one_level(b, first)).sum())
    assert moved_before >= 3
    assert moved <= moved_before // 5


def test_nan_probabilities_still_give_an_index_in_the_vocabulary() -> None:
    probs = torch.full((2, 2 * CHUNK + 3), math.nan)
    probs[1, :CHUNK] = 0.0
    ids = draw(probs, torch.tensor([0.5, 0.99], dtype=torch.float64))
    assert ((ids >= 0) & (ids < probs.shape[1])).all()

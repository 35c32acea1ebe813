"""A sampling request's draws are a function of (seed, token index): the same numbers however a
token is reached (one per step, skipped by a resume or a verification's kept drafts), unrelated
ones for nearby seeds and indexes."""

from __future__ import annotations

import torch

from pytgi_shard.sample.chooser import NextTokenChooser, SamplingParams, Watermark
from pytgi_shard.sample.token_draws import TokenDraws, token_seed

CPU = torch.device("cpu")


def numbers(draws: TokenDraws, offset: int = 0) -> list[float]:
    return torch.rand(4, dtype=torch.float64, generator=draws.generator(CPU, offset)).tolist()


def test_a_tokens_numbers_depend_on_its_seed_and_index_alone() -> None:
    a = TokenDraws(7)
    first = numbers(a, 3)
    numbers(a, 0)
    assert numbers(a, 3) == first  # reseeded: nothing consumed in between matters
    assert numbers(TokenDraws(7, index=3)) == first
    assert numbers(a.at(3)) == first


def test_nearby_seeds_and_indexes_get_distinct_generator_seeds() -> None:
    seeds = {token_seed(s, i) for s in range(100) for i in range(100)}
    assert len(seeds) == 100 * 100
    assert all(0 <= s < 2**63 for s in seeds)
    assert numbers(TokenDraws(1, 2)) != numbers(TokenDraws(2, 1))


def test_a_resumed_chooser_draws_the_next_tokens_of_an_uninterrupted_one() -> None:
    params = [SamplingParams(do_sample=True, seed=5)]
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0)) * 0.3
    history, lengths = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    whole = NextTokenChooser.create(params, CPU, Watermark())
    tokens = [int(whole(logits.clone(), history, lengths)[0]) for _ in range(12)]
    resumed = NextTokenChooser.create(params, CPU, Watermark())
    resumed.skip_draws([7])
    assert [int(resumed(logits.clone(), history, lengths)[0]) for _ in range(5)] == tokens[7:]
    assert len(set(tokens)) > 3

"""Sampling rows draft and are verified exactly (issue 30): on a tiny vocabulary whose target is a
Markov chain (the logits at a position depend on its input token alone), a seeded request's
tokens through verification steps are the tokens it gets without drafts, and over many seeds the
first, second and third tokens follow the target's marginals (chi-square); a wrong rule (every
draft kept) fails the same test."""

from __future__ import annotations

import pytest
import torch

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.engine import verification
from pytgi_shard.engine.batch import Batch
from pytgi_shard.engine.drafting import Drafts
from pytgi_shard.engine.generation import choose_tokens, emit_generations
from pytgi_shard.engine.verification import Verifying, kept_tokens, verify_inputs
from pytgi_shard.output.detokenizer import Detokenizer
from pytgi_shard.output.wire import GenerationWriter
from tests.unit.shard.engine.test_batch import batch_of, request
from tests.unit.shard.engine.test_speculation import VOCAB, context, detok

__all__ = ["detok"]  # the fixture: the same tokenizer as test_speculation.py's

# The chain's states: six tokens of the vocabulary (the others have probability 0).
STATES = [40, 41, 42, 43, 44, 45]
TOKENS = 3
SEEDS = 2500
# Chi-square critical value for 5 degrees of freedom at significance 1e-3.
CHI2_CRITICAL = 20.515
SAMPLED = pb.NextTokenChooserParameters(do_sample=True)
WARPED = pb.NextTokenChooserParameters(temperature=0.7, top_k=4)
PENALISED = pb.NextTokenChooserParameters(temperature=0.8, repetition_penalty=1.5)


def chain() -> torch.Tensor:
    """[VOCAB, VOCAB] logits of the next token given the input token: a random chain over
    STATES (every other token -inf), peaked on state + 1 so that drafts are often kept."""
    g = torch.Generator().manual_seed(7)
    logits = torch.full((VOCAB, VOCAB), float("-inf"))
    states = torch.tensor(STATES)
    for i, s in enumerate(STATES):
        row = torch.randn(len(STATES), generator=g)
        row[(i + 1) % len(STATES)] += 1.5
        logits[s, states] = row
    return logits


TABLE = chain()
# The drafter: always the chain's likeliest walk from the prompt's token.
DRAFTS = [41, 42, 43]


def generate(seeds: list[int], params: pb.NextTokenChooserParameters, draft: bool,
             detok: Detokenizer, noise: bool = False) -> list[list[int]]:
    """TOKENS tokens of each of a batch of seeded requests with prompt [40] (one request per
    seed; rows are chosen as if alone), each step verifying up to 3 drafts per row (`draft`)
    or choosing one token; `noise`: sampling rows draw as on an accelerator (argmax of p / E
    with a vocabulary of Exponential(1) noise per token), not by the CPU's inverse transform."""
    reqs = []
    for rid, seed in enumerate(seeds):
        chosen = pb.NextTokenChooserParameters()
        chosen.CopyFrom(params)
        chosen.seed = seed
        reqs.append(request(rid, [STATES[0]], max_new=TOKENS, blocks=[1], ignore_eos=True,
                            parameters=chosen))
    batch: Batch | None = Batch.from_pb(batch_of(*reqs), context())
    writer = GenerationWriter(detok.special_ids)
    out: list[list[int]] = [[] for _ in seeds]
    while batch is not None:
        batch.chooser.inverse_transform = not noise
        ks = [min(len(DRAFTS), TOKENS - len(out[rid]) - 1) for rid in batch.request_ids]
        rows = [row for row, k in enumerate(ks) if k > 0]
        drafts = Drafts(rows, [DRAFTS[: ks[row]] for row in rows]) if draft and rows else None
        inputs = verify_inputs(batch, drafts) if drafts is not None else batch.decode_inputs()
        logits = TABLE[inputs.input_ids]
        choice = choose_tokens(batch, logits.index_select(0, inputs.last_rows))
        response, finished = emit_generations(batch, choice, detok, writer)
        if drafts is not None:
            finished = kept_tokens(
                batch, response, finished, Verifying(logits, inputs, drafts), detok
            )
        for g in response.generations:
            out[g.request_id].extend(g.tokens.ids)
        keep = [rid for rid in batch.request_ids if rid not in set(finished)]
        batch = batch.filter(keep) if keep else None
    return out


def warped(logits: torch.Tensor, params: pb.NextTokenChooserParameters) -> torch.Tensor:
    """The chooser's distribution of one row of the table under `params` (no penalty)."""
    scores = logits / (params.temperature or 1.0)
    if params.top_k:
        kth = scores.topk(params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    return torch.softmax(scores, dim=-1)


def marginals(params: pb.NextTokenChooserParameters) -> list[torch.Tensor]:
    """The exact distribution of the 1st, 2nd and 3rd token (over STATES)."""
    step = torch.stack([warped(TABLE[s], params)[STATES] for s in STATES])  # [from, to]
    first = step[0]
    return [first, first @ step, first @ step @ step]


def chi_square(tokens: list[int], probs: torch.Tensor) -> float:
    index = torch.tensor([STATES.index(t) for t in tokens])
    observed = torch.bincount(index, minlength=len(STATES)).double()
    expected = probs.double() * len(tokens)
    seen = expected > 0
    assert observed[~seen].sum() == 0, "a token of probability 0 was emitted"
    return float(((observed[seen] - expected[seen]) ** 2 / expected[seen]).sum())


@pytest.mark.parametrize("noise", [False, True], ids=["cpu-draw", "noise-draw"])
@pytest.mark.parametrize("params", [SAMPLED, WARPED, PENALISED],
                         ids=["sampled", "temperature-top-k", "repetition-penalty"])
def test_a_seeded_request_draws_the_same_tokens_with_and_without_drafts(
    params: pb.NextTokenChooserParameters, noise: bool, detok: Detokenizer
) -> None:
    seeds = list(range(60))
    runs = list(zip(generate(seeds, params, True, detok, noise),
                    generate(seeds, params, False, detok, noise), strict=True))
    assert all(drafted == plain for drafted, plain in runs)
    assert len({tuple(plain) for _, plain in runs}) > 5
    # Some of them kept drafts (the chain's likeliest walk), some did not.
    kept = sum(plain[:2] == DRAFTS[:2] for _, plain in runs)
    assert 0 < kept < 60


@pytest.mark.parametrize("params", [SAMPLED, WARPED], ids=["sampled", "temperature-top-k"])
def test_each_token_follows_the_targets_distribution(
    params: pb.NextTokenChooserParameters, detok: Detokenizer
) -> None:
    runs = generate(list(range(SEEDS)), params, True, detok)
    for position, probs in enumerate(marginals(params)):
        stat = chi_square([r[position] for r in runs], probs)
        assert stat < CHI2_CRITICAL, f"token {position}: chi-square {stat:.1f}"


def test_a_rule_that_keeps_every_draft_fails_the_test(
    detok: Detokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def keep_all(chosen: list[int], drafts: list[int]) -> int:
        return len(drafts)

    monkeypatch.setattr(verification, "kept_count", keep_all)
    runs = generate(list(range(SEEDS // 5)), SAMPLED, True, detok)
    second = chi_square([r[1] for r in runs], marginals(SAMPLED)[1])
    assert second > CHI2_CRITICAL

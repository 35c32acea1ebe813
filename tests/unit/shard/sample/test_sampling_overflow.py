"""Parameters that push scores past float32's range: the row stays a distribution (finite
logprobs, a token it allows), never NaN read as token 0; non-finite parameters are refused."""

from __future__ import annotations

import math

import pytest
import torch

from pytgi_proto import generate_pb2
from pytgi_shard.errors import InvalidRequest
from pytgi_shard.sample.chooser import NextTokenChooser, SamplingParams, Watermark, top_tokens

CPU = torch.device("cpu")
VOCAB = 512
NEG_INF = float("-inf")
PROMPT = [7, 40, 41, 300, 7]


def from_wire(**fields: float | bool | int) -> SamplingParams:
    """The parameters as a shard reads them: through the proto's float32 fields."""
    return SamplingParams.from_pb(generate_pb2.NextTokenChooserParameters(**fields))  # type: ignore[arg-type]


def logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    row = torch.randn(VOCAB, generator=g) * 4
    row[[7, 40]] = torch.tensor([2.5, 1.0])  # seen, positive
    row[[41, 300]] = torch.tensor([-3.0, -0.5])  # seen, negative
    row[0] = 1.0  # unseen
    return row


def decode(
    params: list[SamplingParams], steps: int, banned: torch.Tensor | None = None
) -> list[tuple[list[int], torch.Tensor]]:
    """Each step's (ids, logprobs) for rows that all see `logits()` after PROMPT (plus what
    they generated); `banned`: a float32 bias applied to every row."""
    chooser = NextTokenChooser.create(params, CPU, Watermark())
    rows = len(params)
    histories = [list(PROMPT) for _ in range(rows)]
    out = []
    for _ in range(steps):
        history = torch.tensor(histories)
        lengths = torch.full((rows,), history.shape[1])
        ban = None if banned is None else (None, banned.expand(rows, VOCAB).clone())
        ids, logprobs = chooser(logits().repeat(rows, 1), history, lengths, ban)
        for h, token in zip(histories, ids.tolist(), strict=True):
            h.append(token)
        out.append((ids.tolist(), logprobs.clone()))
    return out


def assert_a_distribution(logprobs: torch.Tensor) -> None:
    assert not logprobs.isnan().any()
    totals = logprobs.double().exp().sum(dim=-1)
    torch.testing.assert_close(totals, torch.ones_like(totals))


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({"repetition_penalty": 1e-40}, id="repetition-1e-40"),
        pytest.param({"repetition_penalty": 1e-40, "do_sample": True, "seed": 4}, id="sampled"),
        pytest.param(
            {"repetition_penalty": 1e-40, "temperature": 0.5, "top_p": 0.9, "typical_p": 0.9,
             "seed": 4},
            id="warped",
        ),
        pytest.param({"repetition_penalty": -1.9999999 + 2.0, "seed": 4}, id="presence--1.9999999"),
    ],
)
def test_a_tiny_repetition_penalty_chooses_a_seen_token_with_finite_logprobs(
    fields: dict[str, float | bool | int],
) -> None:
    # CTRL divides a seen positive logit by the penalty: 2.5 / 1e-40 is past float32's range.
    # The seen positive tokens (7 and 40) win; NaN logprobs and token 0 were the answer.
    for ids, logprobs in decode([from_wire(**fields)], steps=6):
        assert_a_distribution(logprobs)
        assert ids[0] in (7, 40)


def test_saturated_tokens_tie_at_the_top_and_the_rest_keep_their_order() -> None:
    [(ids, logprobs)] = decode([from_wire(repetition_penalty=1e-40)], steps=1)
    assert ids == [7]  # both seen positive tokens overflow: a tie, the lower id first
    assert logprobs[0, 7] == logprobs[0, 40] == pytest.approx(-math.log(2))
    assert top_tokens(logprobs, [2]) == [([7, 40], [logprobs[0, 7].item()] * 2)]


def test_a_huge_penalty_on_a_row_that_saw_every_token_stays_a_distribution() -> None:
    # The grammar allows only logits below -4, all of them seen: x * 1e38 is -inf for each, a
    # row of -inf (NaN logprobs) without the bound.
    row = logits()
    allowed = (row < -4).nonzero().squeeze(1)
    banned = torch.full((1, VOCAB), NEG_INF).index_fill_(1, allowed, 0.0)
    chooser = NextTokenChooser.create([from_wire(repetition_penalty=1e38)], CPU, Watermark())
    history = allowed.unsqueeze(0)
    ids, logprobs = chooser(row.unsqueeze(0), history, torch.tensor([len(allowed)]),
                            (None, banned))
    assert_a_distribution(logprobs)
    assert ids.item() in allowed.tolist()
    assert int(logprobs.isfinite().sum()) == len(allowed)


def test_a_tiny_temperature_is_the_argmax_with_finite_logprobs() -> None:
    # The router sends temperatures below 1e-5 as greedy; a shard still never makes NaN of one.
    expected = int(logits().argmax())
    for fields in ({"temperature": 1e-40, "seed": 1}, {"temperature": 1e-38, "top_k": 3}):
        for ids, logprobs in decode([from_wire(**fields)], steps=3):
            assert_a_distribution(logprobs)
            assert ids == [expected]


def test_a_banned_token_stays_banned_where_the_others_saturate() -> None:
    banned = torch.zeros(VOCAB)
    banned[7] = NEG_INF  # seen, positive: would saturate at the top
    for ids, logprobs in decode([from_wire(repetition_penalty=1e-40)], steps=3, banned=banned):
        assert ids == [40]
        assert logprobs[0, 7] == NEG_INF
        assert_a_distribution(logprobs)


def test_a_neighbour_of_an_overflowing_row_is_chosen_as_alone() -> None:
    neighbour = SamplingParams(do_sample=True, seed=9, temperature=0.8)
    alone = decode([neighbour], steps=5)
    beside = decode([from_wire(repetition_penalty=1e-40), neighbour], steps=5)
    for (ids_a, lp_a), (ids_b, lp_b) in zip(alone, beside, strict=True):
        assert ids_a[0] == ids_b[1] and torch.equal(lp_a[0], lp_b[1])


@pytest.mark.parametrize(
    "name", ["temperature", "top_p", "typical_p", "repetition_penalty", "frequency_penalty"]
)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_parameters_are_refused(name: str, value: float) -> None:
    with pytest.raises(InvalidRequest, match=f"{name} must be a finite number"):
        from_wire(**{name: value})

"""The next-token chooser against transformers' own logits processors, row by row."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from pytgi_proto import generate_pb2
from pytgi_shard.errors import InvalidRequest
from pytgi_shard.sample.chooser import (
    NextTokenChooser,
    SamplingParams,
    Watermark,
    top_tokens,
)
from pytgi_shard.sample.processors import token_counts

CPU = torch.device("cpu")
VOCAB = 50


def chooser(*params: SamplingParams) -> NextTokenChooser:
    return NextTokenChooser.create(params, CPU, Watermark())


def history(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    return ids, torch.tensor([len(r) for r in rows])


def hf_processed(p: SamplingParams, ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    """What transformers' processors make of one row, in TGI's order."""
    processors = []
    if p.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    if p.temperature != 1.0:
        processors.append(TemperatureLogitsWarper(p.temperature))
    if p.top_k:
        processors.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        processors.append(TopPLogitsWarper(p.top_p))
    if p.typical_p < 1.0:
        processors.append(TypicalLogitsWarper(p.typical_p))
    scores = logits.clone().unsqueeze(0)
    input_ids = torch.tensor([ids])
    for proc in processors:
        scores = proc(input_ids, scores)
    return scores.squeeze(0)


def assert_same_logprobs(got: torch.Tensor, expected_scores: torch.Tensor) -> None:
    expected = torch.log_softmax(expected_scores, dim=-1)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    finite = torch.isfinite(expected)
    torch.testing.assert_close(got[finite], expected[finite], rtol=1e-5, atol=1e-5)


def test_greedy_is_argmax_with_logprobs_of_the_raw_logits() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    ids, lengths = history([[1, 2], [3], [4, 5, 6]])
    scores = logits.clone()
    next_ids, logprobs = chooser(*[SamplingParams()] * 3)(scores, ids, lengths)
    assert next_ids.tolist() == logits.argmax(-1).tolist()
    # Bit for bit, written over the scores.
    assert torch.equal(logprobs, torch.log_softmax(logits, -1))
    assert logprobs.data_ptr() == scores.data_ptr()


def test_heterogeneous_processors_match_transformers_row_by_row() -> None:
    torch.manual_seed(1)
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.7, do_sample=True, seed=1),
        SamplingParams(top_k=5, seed=2),
        SamplingParams(top_p=0.6, seed=3),
        SamplingParams(typical_p=0.5, seed=4),
        SamplingParams(repetition_penalty=1.8),
        SamplingParams(repetition_penalty=0.6, temperature=1.3, top_k=20, top_p=0.9, typical_p=0.9),
    ]
    rows = [[1, 2, 3], [4], [5, 6, 5], [7, 8], [9], [10, 11, 12, 10, 3], [0, 1, 49]]
    logits = torch.randn(len(params), VOCAB) * 3
    ids, lengths = history(rows)
    _, logprobs = chooser(*params)(logits.clone(), ids, lengths)
    for i, p in enumerate(params):
        assert_same_logprobs(logprobs[i], hf_processed(p, rows[i], logits[i]))


def test_repetition_penalty_ignores_padding_of_shorter_rows() -> None:
    # Row 1 is padded with id 0 in the history tensor: token 0 must stay untouched there.
    logits = torch.full((2, VOCAB), 2.0)
    ids, lengths = history([[0, 0, 0, 7], [7]])
    p = SamplingParams(repetition_penalty=2.0)
    _, logprobs = chooser(p, p)(logits.clone(), ids, lengths)
    scores = logprobs[1] - logprobs[1].max()
    assert scores[0].item() == pytest.approx(0.0)
    assert scores[7].item() == pytest.approx(-1.0)


def test_frequency_penalty_subtracts_length_normalised_counts() -> None:
    logits = torch.zeros(1, VOCAB)
    ids, lengths = history([[3, 3, 3, 4]])
    _, logprobs = chooser(SamplingParams(frequency_penalty=1.0))(logits.clone(), ids, lengths)
    expected = torch.zeros(VOCAB)
    expected[3], expected[4] = -0.75, -0.25
    assert_same_logprobs(logprobs[0], expected)


def test_token_counts_count_only_within_each_length() -> None:
    ids, _ = history([[1, 1, 2], [2, 2]])
    counts = token_counts(ids, torch.tensor([3, 1]), 4)
    assert counts.tolist() == [[0, 2, 1, 0], [0, 0, 1, 0]]


def run(choose: NextTokenChooser, logits: torch.Tensor, steps: int) -> list[list[int]]:
    ids, lengths = history([[1]] * logits.shape[0])
    out = []
    for _ in range(steps):
        next_ids, _ = choose(logits.clone(), ids, lengths)
        out.append(next_ids.tolist())
    return [list(col) for col in zip(*out, strict=True)]


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch() -> None:
    torch.manual_seed(2)
    logits = torch.randn(1, VOCAB).repeat(3, 1)
    a, b = SamplingParams(do_sample=True, seed=42), SamplingParams(do_sample=True, seed=7)
    alone = run(chooser(a), logits[:1], 20)[0]
    assert run(chooser(a), logits[:1], 20)[0] == alone
    in_batch = run(chooser(b, a, SamplingParams()), logits, 20)
    assert in_batch[1] == alone
    assert in_batch[0] != alone
    assert len(set(alone)) > 1


def test_generators_survive_filter_and_concatenate() -> None:
    torch.manual_seed(3)
    logits = torch.randn(1, VOCAB)
    a, b = SamplingParams(do_sample=True, seed=5), SamplingParams(do_sample=True, seed=6)
    alone = run(chooser(a), logits, 6)[0]
    both = chooser(b, a)
    first = run(both, logits.repeat(2, 1), 3)[1]
    moved = NextTokenChooser.concatenate([chooser(SamplingParams()), both.filter([1])])
    rest = run(moved, logits.repeat(2, 1), 3)[1]
    assert first + rest == alone


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().unsqueeze(0)
    draws = run(chooser(SamplingParams(do_sample=True, seed=11)), logits, 3000)[0]
    freq = [draws.count(i) / len(draws) for i in range(3)]
    assert freq == pytest.approx(probs.tolist(), abs=0.04)


@pytest.mark.parametrize("inverse_transform", [True, False], ids=["cpu-draw", "noise-draw"])
def test_a_warped_row_beside_a_greedy_one_follows_its_distribution(inverse_transform: bool) -> None:
    # Top-p 0.85 of (0.6, 0.3, 0.1) keeps the first two: 2/3 and 1/3, on the CPU's draw and
    # on the accelerator's (exponential noise, run here on the CPU).
    # One step of 3,000 such rows, each with its own seed, beside greedy rows.
    rows = 3000
    params = [SamplingParams(top_p=0.85, seed=i) if i % 3 else SamplingParams() for i in range(rows)]
    choose = chooser(*params)
    choose.inverse_transform = inverse_transform
    logits = torch.tensor([0.6, 0.3, 0.1]).log().repeat(rows, 1)
    ids, lengths = torch.ones(rows, 1, dtype=torch.long), torch.ones(rows, dtype=torch.long)
    draws = choose(logits, ids, lengths)[0].tolist()
    assert set(draws[::3]) == {0}
    sampled = [d for i, d in enumerate(draws) if i % 3]
    freq = [sampled.count(i) / len(sampled) for i in range(3)]
    assert freq == pytest.approx([2 / 3, 1 / 3, 0.0], abs=0.04)


def test_any_warper_implies_sampling_and_top_k_1_is_greedy() -> None:
    assert SamplingParams(top_k=3).samples and SamplingParams(temperature=0.5).samples
    assert not SamplingParams(repetition_penalty=1.5).samples
    torch.manual_seed(4)
    logits = torch.randn(1, VOCAB)
    draws = run(chooser(SamplingParams(top_k=1, seed=3)), logits, 10)[0]
    assert set(draws) == {int(logits.argmax())}


def reference_top_tokens(logprobs: torch.Tensor, n: int) -> tuple[list[int], list[float]]:
    """The plain definition: sort by logprob (descending) then id, keep n finite ones."""
    row = logprobs.tolist()
    order = sorted(range(len(row)), key=lambda i: (-row[i], i))
    kept = [i for i in order if row[i] > float("-inf")][:n]
    return kept, [row[i] for i in kept]


def test_top_tokens_break_ties_by_token_id_never_more_than_n() -> None:
    logprobs = torch.log_softmax(torch.tensor([[3.0, 2.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0, 4.0]]), -1)
    (ids0, lps0), (ids1, lps1) = top_tokens(logprobs, [2, 1])
    assert ids0 == [0, 1] and lps0 == pytest.approx(logprobs[0, :2].tolist())
    assert ids1 == [4] and len(lps1) == 1
    assert top_tokens(logprobs, [0, 0]) == [([], []), ([], [])]
    assert top_tokens(logprobs, [0, 3])[0] == ([], [])


def test_top_tokens_of_a_flat_distribution_are_the_n_lowest_ids() -> None:
    """temperature 1e9 makes every logprob equal: n entries, not the whole vocabulary."""
    logits = torch.randn(3, 393)
    _, logprobs = chooser(*[SamplingParams(temperature=1e9, seed=1)] * 3)(logits, *history([[1]] * 3))
    tops = top_tokens(logprobs, [2, 5, 0])
    assert [ids for ids, _ in tops] == [[0, 1], [0, 1, 2, 3, 4], []]
    assert all(len(lps) == len(ids) for ids, lps in tops)


def test_top_tokens_match_the_sorted_reference_with_many_ties() -> None:
    torch.manual_seed(0)
    # Few distinct values over the vocabulary: ties above, at and below the n-th value.
    logprobs = torch.randint(0, 4, (16, VOCAB)).float().log_softmax(-1)
    logprobs[3, 5:] = float("-inf")
    logprobs[4, :] = logprobs[4, 0]
    top_n = [i % 7 for i in range(16)]
    for row, (ids, lps) in enumerate(top_tokens(logprobs, top_n)):
        assert (ids, lps) == reference_top_tokens(logprobs[row], top_n[row]), row


def test_top_tokens_never_list_filtered_tokens() -> None:
    logprobs = torch.tensor([[0.0, float("-inf"), float("-inf")]])
    assert top_tokens(logprobs, [2]) == [([0], [0.0])]


def test_watermark_biases_the_green_list_of_the_previous_token() -> None:
    mark = Watermark(gamma=0.5, delta=2.0)
    green = mark.greenlist(17, VOCAB)
    assert len(green) == VOCAB // 2 and torch.equal(green, mark.greenlist(17, VOCAB))
    assert not torch.equal(green, mark.greenlist(18, VOCAB))
    logits = torch.zeros(1, VOCAB)
    ids, lengths = history([[3, 17]])
    _, logprobs = chooser(SamplingParams(watermark=True))(logits, ids, lengths)
    gap = logprobs[0, green].mean() - logprobs[0].min()
    assert gap.item() == pytest.approx(2.0)


def test_params_from_proto_read_zero_as_unset_and_reject_bad_values() -> None:
    p = SamplingParams.from_pb(generate_pb2.NextTokenChooserParameters())
    assert p == SamplingParams() and not p.samples
    with pytest.raises(InvalidRequest, match="temperature"):
        SamplingParams.from_pb(generate_pb2.NextTokenChooserParameters(temperature=-1.0))
    with pytest.raises(InvalidRequest, match="top_p"):
        SamplingParams.from_pb(generate_pb2.NextTokenChooserParameters(top_p=1.5))


def test_sampling_never_picks_an_impossible_token() -> None:
    logits = torch.tensor([[0.0, math.log(1e-3), float("-inf")]])
    draws = run(chooser(SamplingParams(do_sample=True, seed=1)), logits, 500)[0]
    assert 2 not in draws

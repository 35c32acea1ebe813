"""Top-p and typical-p over the top-k candidates against the plain full-sort warpers: the same
scores bit for bit, ties, -inf and rows that keep more than k tokens included."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pytgi_shard.sample.candidate_warpers import top_candidates, top_p_over, typical_p_over
from pytgi_shard.sample.chooser import (
    NextTokenChooser,
    SamplingParams,
    Watermark,
    _top_k,
    _top_p,
    _typical_p,
)

NEG_INF = float("-inf")
# Few distinct values: ties everywhere, at the k-th value and at the top-p / typical-p cut.
_VALUES = st.sampled_from([0.0, 1.0, 1.0, 2.0, 2.0, 3.0, -1.5, 0.25, NEG_INF])
_MASS = st.sampled_from([1.0, 0.999, 0.9, 0.75, 0.5, 0.5, 1 / 3, 0.25, 0.01, 1e-8])


def column(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).unsqueeze(1)


def warped(
    scores: torch.Tensor, top_k: list[int], top_p: list[float] | None, typical: list[float] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(plain warpers, candidate warpers) on copies of `scores`."""
    k = torch.tensor(top_k).unsqueeze(1)
    plain, fast = scores.clone(), scores.clone()
    _top_k(plain, k, max(top_k))
    if top_p is not None:
        _top_p(plain, column(top_p))
    if typical is not None:
        _typical_p(plain, column(typical))
    candidates = top_candidates(fast, _top_k(fast, k, max(top_k)))
    if top_p is not None:
        top_p_over(fast, candidates, column(top_p))
    if typical is not None:
        typical_p_over(fast, candidates, column(typical))
    return plain, fast


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    rows=st.integers(1, 4),
    vocab=st.integers(2, 40),
    scale=st.sampled_from([1.0, 0.3, 7.0]),
    warpers=st.sampled_from(["top_p", "typical", "both"]),
)
def test_candidates_give_the_full_sort_scores_bit_for_bit(
    data: st.DataObject, rows: int, vocab: int, scale: float, warpers: str
) -> None:
    values = data.draw(st.lists(_VALUES, min_size=rows * vocab, max_size=rows * vocab))
    scores = torch.tensor(values, dtype=torch.float32).view(rows, vocab) * scale
    top_k = data.draw(st.lists(st.integers(1, vocab + 2), min_size=rows, max_size=rows))
    top_p = data.draw(st.lists(_MASS, min_size=rows, max_size=rows))
    typical = data.draw(st.lists(_MASS, min_size=rows, max_size=rows))
    plain, fast = warped(
        scores,
        top_k,
        top_p if warpers != "typical" else None,
        typical if warpers != "top_p" else None,
    )
    assert torch.equal(plain, fast)


def test_ties_at_the_cut_leave_the_higher_ids_first() -> None:
    # Two equally likely tokens and top-p 0.5: the cut falls between them; the stable sort
    # removes the lower id (it comes first in ascending order), on every path.
    scores = torch.tensor([[0.0, 5.0, 5.0, NEG_INF]])
    plain, fast = warped(scores, [2], [0.5], None)
    assert torch.equal(plain, fast)
    assert plain.tolist() == [[NEG_INF, NEG_INF, 5.0, NEG_INF]]


def test_rows_that_keep_more_than_k_widen_the_candidates() -> None:
    scores = torch.tensor([[1.0, 2.0, 2.0, 2.0, 2.0, 0.5], [3.0, 2.0, 1.0, 0.0, -1.0, -2.0]])
    k = torch.tensor([[2], [1]])
    ids = _top_k(scores, k, 2)
    candidates = top_candidates(scores, ids)
    assert candidates.shape[1] == 4
    assert candidates[0].tolist() == [1, 2, 3, 4]
    assert scores[1, candidates[1]].isfinite().sum() == 1


@pytest.mark.parametrize("top_p, typical_p", [(0.8, 1.0), (1.0, 0.7), (0.9, 0.95)])
def test_the_chooser_uses_the_candidates_when_every_row_has_a_top_k(
    monkeypatch: pytest.MonkeyPatch, top_p: float, typical_p: float
) -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 300) * 3
    ids, lengths = torch.zeros(4, 1, dtype=torch.long), torch.ones(4, dtype=torch.long)
    params = [
        SamplingParams(top_k=k, top_p=top_p, typical_p=typical_p, temperature=t, seed=i)
        for i, (k, t) in enumerate([(5, 1.0), (40, 0.7), (1, 1.0), (300, 1.3)])
    ]
    cpu = torch.device("cpu")
    expected = NextTokenChooser.create(params, cpu, Watermark())(logits.clone(), ids, lengths)

    def no_sort(*args: object) -> None:
        raise AssertionError("the full-sort warper ran")

    monkeypatch.setattr("pytgi_shard.sample.chooser._top_p", no_sort)
    monkeypatch.setattr("pytgi_shard.sample.chooser._typical_p", no_sort)
    got = NextTokenChooser.create(params, cpu, Watermark())(logits.clone(), ids, lengths)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    mixed = [*params[:3], SamplingParams(top_p=top_p, typical_p=typical_p)]
    with pytest.raises(AssertionError, match="full-sort"):
        NextTokenChooser.create(mixed, cpu, Watermark())(logits.clone(), ids, lengths)

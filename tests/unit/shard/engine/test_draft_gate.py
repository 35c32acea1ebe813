"""The sampling rows' drafting gate (drafting.confident, verification.note_confidence): a
sampling row proposes only after a token the target gave at least CONFIDENT; greedy rows are
never gated; the served engine asks no drafts of a row sampling from a flat distribution, and
asks them again without the gate."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.engine import drafting
from pytgi_shard.engine.batch import Batch
from pytgi_shard.engine.drafter import NgramDrafter
from pytgi_shard.engine.drafting import CONFIDENT, Drafts, DraftState, confident, plan_asks
from pytgi_shard.engine.engine import Engine
from pytgi_shard.engine.verification import note_confidence
from tests.unit.shard.engine.test_batch import batch_of, request
from tests.unit.shard.engine.test_speculation import context, greedy, pair, serve

__all__ = ["pair"]

QUOTED = [5, 6, 7, 8, 9, 10, 11, 12] * 4


def test_greedy_rows_are_never_gated() -> None:
    assert confident(False, math.log(1e-6))
    assert confident(False, -math.inf)


def test_sampling_rows_propose_after_a_likely_token_only() -> None:
    assert confident(True, math.log(CONFIDENT))
    assert confident(True, math.log(0.99))
    assert not confident(True, math.log(CONFIDENT * 0.9))
    assert not confident(True, -math.inf)
    # A threshold of 0 gates nothing (the rule before the gate).
    assert confident(True, -math.inf, threshold=0.0)
    assert not confident(True, math.log(0.6), threshold=0.7)


def test_plan_skips_an_unconfident_row_and_keeps_its_pause() -> None:
    sure, unsure = DraftState.start([1, 2, 1]), DraftState.start([1, 2, 1])
    unsure.confident = False
    assert plan_asks([unsure, sure], [4, 4], [9, 9], 4) == [(1, 4)]
    # A paused row's pause counts down whether or not it is confident.
    unsure.paused = 2
    plan_asks([unsure], [4], [9], 4)
    assert unsure.paused == 1
    unsure.confident = True
    assert plan_asks([unsure], [4], [9], 4) == []
    assert plan_asks([unsure], [4], [9], 4) == [(0, 4)]


def response_with(logprobs: Sequence[Sequence[float]]) -> pb.DecodeResponse:
    out = pb.DecodeResponse()
    for rid, lps in enumerate(logprobs):
        g = out.generations.add(request_id=rid)
        g.tokens.logprobs.extend(lps)
    return out


def test_the_step_notes_each_rows_latest_token() -> None:
    sampled = pb.NextTokenChooserParameters(do_sample=True, seed=3)
    reqs = [request(0, [5, 6]), request(1, [5, 6], parameters=sampled),
            request(2, [5, 6], parameters=sampled)]
    batch = Batch.from_pb(batch_of(*reqs), context())
    low, high = math.log(0.05), math.log(0.9)
    # Row 2's step kept drafts: its latest token (the last one emitted) decides.
    note_confidence(batch, response_with([[low], [low], [low, low, high]]))
    assert [r.draft.confident for r in batch.requests if r.draft] == [True, False, True]
    note_confidence(batch, response_with([[low], [high], [high, low]]))
    assert [r.draft.confident for r in batch.requests if r.draft] == [True, True, False]


class CountingDrafter(NgramDrafter):
    """The n-gram drafter, counting the rows each step asks it for."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def propose(self, batch: Batch, asks: Sequence[tuple[int, int]]) -> Drafts | None:
        self.asked.extend(batch.requests[row].id for row, _ in asks)
        return super().propose(batch, asks)


def test_a_row_sampling_a_flat_distribution_asks_no_drafts(
    pair: tuple[Engine, Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    plain, speculating = pair
    # The random model's distributions are wide: at temperature 1.5 no token is likely.
    hot = pb.NextTokenChooserParameters(do_sample=True, seed=21, temperature=1.5)
    reqs = [greedy(0, QUOTED, 12), greedy(1, QUOTED, 12, parameters=hot)]
    counting = CountingDrafter()
    monkeypatch.setattr(speculating, "drafter", counting)
    expected, _ = serve(plain, reqs)
    got, _ = serve(speculating, reqs)
    assert got.tokens == expected.tokens
    assert 0 in counting.asked and 1 not in counting.asked
    # Without the gate the same row is asked (and its tokens stay the plain run's).
    monkeypatch.setattr(drafting, "CONFIDENT", 0.0)
    counting.asked.clear()
    got, _ = serve(speculating, reqs)
    assert got.tokens == expected.tokens
    assert 1 in counting.asked

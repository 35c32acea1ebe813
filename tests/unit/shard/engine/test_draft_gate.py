"""The sampling rows' back-off (drafting.back_off): a sampling row pauses drafting after its
first missed proposal and for longer than a greedy row, which keeps GREEDY_BACK_OFF; the served
engine records each proposal with its row's kind, so a hot sampling row proposes less often than
under the greedy rule over the same steps, with the same tokens."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.engine import drafting
from pytgi_shard.engine.batch import Batch
from pytgi_shard.engine.drafting import (
    GREEDY_BACK_OFF,
    SAMPLING_BACK_OFF,
    BackOff,
    Drafts,
    DraftState,
    back_off,
    plan_asks,
)
from pytgi_shard.engine.engine import Engine
from tests.unit.shard.engine.test_speculation import greedy, pair, serve

__all__ = ["pair"]


def test_pauses_double_up_to_the_longest() -> None:
    rule = BackOff(1, 16, 256)
    assert [rule.pause(n) for n in range(7)] == [16, 32, 64, 128, 256, 256, 256]
    assert rule.pause(10_000) == 256


def test_a_sampling_row_pauses_at_its_first_miss_and_longer() -> None:
    assert back_off(True) == SAMPLING_BACK_OFF and back_off(False) == GREEDY_BACK_OFF
    assert SAMPLING_BACK_OFF.misses == 1 < GREEDY_BACK_OFF.misses
    assert SAMPLING_BACK_OFF.first > GREEDY_BACK_OFF.first
    sampled, argmax = DraftState.start([1, 2, 1]), DraftState.start([1, 2, 1])
    sampled.record(4, 0, sampling=True)
    argmax.record(4, 0, sampling=False)
    first = SAMPLING_BACK_OFF.first
    assert sampled.paused == first and argmax.paused == 0
    # The paused row is not asked for the pause's steps; the greedy row is.
    for _ in range(first):
        assert plan_asks([sampled, argmax], [4, 4], [9, 9], 4) == [(1, 4)]
    assert plan_asks([sampled, argmax], [4, 4], [9, 9], 4) == [(0, 4), (1, 4)]
    # Each further miss doubles the pause; a kept draft resets it.
    sampled.record(4, 0, sampling=True)
    assert sampled.paused == 2 * first
    sampled.paused = 0
    sampled.record(4, 2, sampling=True)
    sampled.record(4, 0, sampling=True)
    assert sampled.paused == first


def test_a_greedy_row_keeps_its_rule() -> None:
    state = DraftState.start([1, 2, 1])
    pauses = []
    for _ in range(12):
        state.record(4, 0)
        pauses.append(state.paused)
        state.paused = 0
    assert pauses == [0, 4, 0, 8, 0, 16, 0, 32, 0, 64, 0, 64]


def test_the_rule_is_read_at_each_record(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(drafting, "SAMPLING_BACK_OFF", BackOff(2, 3, 5))
    state = DraftState.start([1, 2, 1])
    state.record(4, 0, sampling=True)
    assert state.paused == 0
    state.record(4, 0, sampling=True)
    assert state.paused == 3


class SteadyDrafter:
    """Proposes token 3 k times for every asked row (a drafter the hot rows' target rarely
    agrees with), counting the proposals."""

    name = "steady"

    def __init__(self) -> None:
        self.proposals = 0

    def propose(self, batch: Batch, asks: Sequence[tuple[int, int]]) -> Drafts | None:
        self.proposals += len(asks)
        return Drafts([row for row, _ in asks], [[3] * k for _, k in asks]) if asks else None


QUOTED = [5, 6, 7, 8, 9, 10, 11, 12] * 4


def test_a_hot_sampling_row_proposes_less_often_than_under_the_greedy_rule(
    pair: tuple[Engine, Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    plain, speculating = pair
    # The random model's distributions are wide: at temperature 1.5 a draft of token 3 is
    # almost never kept, and each miss pauses the row.
    hot = pb.NextTokenChooserParameters(do_sample=True, seed=21, temperature=1.5)
    reqs = [greedy(0, QUOTED, 24, parameters=hot)]
    expected, _ = serve(plain, reqs)
    asked: dict[BackOff, int] = {}
    for rule in (SAMPLING_BACK_OFF, GREEDY_BACK_OFF):
        drafter = SteadyDrafter()
        monkeypatch.setattr(speculating, "drafter", drafter)
        monkeypatch.setattr(drafting, "SAMPLING_BACK_OFF", rule)
        got, _ = serve(speculating, reqs)
        assert got.tokens == expected.tokens
        asked[rule] = drafter.proposals
    assert 0 < asked[SAMPLING_BACK_OFF] < asked[GREEDY_BACK_OFF]

"""The prefill budget's policy (shard/engine/prefill_budget.py) on plain numbers: when the ladder
stops, which rung it serves with, and the bounds that override the throughput."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pytgi_shard.engine.prefill_budget import (
    Bounds,
    LadderPolicy,
    Rung,
    choose,
    memory_bound,
    next_rung,
)

POLICY = LadderPolicy()
OPEN = Bounds(ceiling=POLICY.top_rung, ceiling_why="the ladder's top")


def saturating(overhead_s: float, peak_tok_s: float) -> Callable[[int], float]:
    """A device whose step costs a fixed overhead plus tokens at its peak rate."""
    return lambda tokens: overhead_s + tokens / peak_tok_s


def climb(
    step_s: Callable[[int], float],
    bounds: Bounds = OPEN,
    policy: LadderPolicy = POLICY,
    peak_per_token: int = 0,
) -> tuple[list[Rung], str]:
    """Runs the ladder against a model of the device, as Warmup runs it against the device."""
    rungs: list[Rung] = []
    while True:
        step = next_rung(rungs, bounds, policy)
        if step.tokens is None:
            return rungs, step.why
        rungs.append(Rung(step.tokens, step_s(step.tokens), step.tokens * peak_per_token))


def test_a_saturating_device_gets_the_knee_not_the_top() -> None:
    # 5 ms of overhead a step, then 100k tok/s: 2048 tokens reach 80% of the rate, 4096 89%,
    # 8192 94%, 16384 97%: past 16384 doubling buys < 10%.
    rungs, stopped = climb(saturating(0.005, 100_000))
    choice = choose(rungs, OPEN, POLICY, stopped)
    assert [r.tokens for r in rungs] == [256, 512, 1024, 2048, 4096, 8192, 16384]
    assert "rose < 10% over the last two doublings" in stopped
    peak = max(r.throughput for r in rungs)
    assert choice.tokens == 4096
    assert rungs[4].throughput >= 0.9 * peak > rungs[3].throughput
    assert "4096 is the smallest within 10% of the peak" in choice.why
    assert "256/512/1024/2048/4096/8192/16384 tokens" in choice.why


def test_a_slow_device_stops_at_the_step_time() -> None:
    # 2k tok/s: 1024 tokens take 0.51 s, over the 0.5 s one step may stall the streams.
    rungs, stopped = climb(saturating(0.001, 2_000))
    assert [r.tokens for r in rungs] == [256, 512]
    assert "would take" in stopped
    assert choose(rungs, OPEN, POLICY, stopped).tokens == 256


def test_a_rung_over_the_step_time_is_not_chosen_unless_it_is_the_smallest() -> None:
    rungs = [Rung(256, 0.1), Rung(512, 0.7)]  # 2.5k then 731 tok/s: the second is also slower
    assert choose(rungs, OPEN, POLICY, "test").tokens == 256
    slow = [Rung(256, 0.9), Rung(512, 1.0)]
    assert choose(slow, OPEN, POLICY, "test").tokens == 256


def test_the_budget_bounds_the_measuring() -> None:
    policy = LadderPolicy(budget_s=0.05, max_step_s=10.0)
    rungs, stopped = climb(saturating(0.005, 1e6), policy=policy)
    assert rungs[-1].throughput > 1.1 * rungs[-2].throughput
    spent = sum(r.seconds for r in rungs) * policy.repeats
    assert spent <= policy.budget_s and "budget" in stopped
    # Throughput never stopped rising: the top rung measured is served.
    assert choose(rungs, OPEN, policy, stopped).tokens == rungs[-1].tokens


def test_the_budget_counts_the_wall_time_a_busy_host_spent() -> None:
    # The first rung's wall time may hold one-time costs (compiling kernels): not counted.
    assert next_rung([Rung(256, 0.01, spent_s=100.0)], OPEN, POLICY).tokens == 512
    # Later rungs count all their runs: 0.03 + 2.9 s spent, 1024 would take ~0.12 s more.
    busy = [Rung(256, 0.01, spent_s=100.0), Rung(512, 0.02, spent_s=2.9)]
    assert next_rung(busy, OPEN, POLICY).why == "measuring 1024 would pass the ladder's 3 s budget"
    quiet = [Rung(256, 0.01), Rung(512, 0.02)]
    assert next_rung(quiet, OPEN, POLICY).tokens == 1024


def test_the_ceiling_stops_the_ladder_and_caps_the_last_rung() -> None:
    bounds = Bounds(ceiling=3000, ceiling_why="the KV budget (3000 tokens)")
    rungs, stopped = climb(lambda t: 0.01 + t / 1e9, bounds)
    assert [r.tokens for r in rungs] == [256, 512, 1024, 2048, 3000]
    assert stopped == "the KV budget (3000 tokens)"
    tiny = Bounds(ceiling=100, ceiling_why="the KV budget")
    assert next_rung([], tiny, POLICY).tokens == 100


def test_measured_activations_bound_the_ladder_and_the_choice() -> None:
    # 40 KiB a token measured, 120 KiB of logits a token, 1 GiB allowed: 6553 tokens.
    bounds = Bounds(ceiling=POLICY.top_rung, ceiling_why="top", activation_bytes=2**30,
                    logits_bytes_per_token=120 * 1024)
    assert memory_bound([Rung(1024, 0.01, 1024 * 40 * 1024)], bounds) == 6553
    rungs, stopped = climb(lambda t: 0.01 + t / 1e9, bounds, peak_per_token=40 * 1024)
    assert rungs[-1].tokens == 6553 and "activation memory bounds it at 6553" in stopped
    choice = choose(rungs, bounds, POLICY, stopped)
    assert choice.tokens == 6553 and "fit 6553 tokens in 1.0 GiB" in choice.why
    # The largest rung's ratio counts: a fixed workspace weighs less there.
    with_workspace = [Rung(256, 0.01, 2**26), Rung(4096, 0.01, 2**26 + 4096 * 1024)]
    assert memory_bound(with_workspace, Bounds(1, "", 2**30)) == 2**30 * 4096 // (2**26 + 2**22)


def test_memory_is_unbounded_where_it_was_not_measured() -> None:
    assert memory_bound([Rung(256, 0.01)], Bounds(1, "", activation_bytes=2**30)) is None
    assert memory_bound([Rung(256, 0.01, 10)], Bounds(1, "")) is None
    assert "not measured" in choose([Rung(256, 0.01)], OPEN, POLICY, "test").why


def test_a_shard_that_cannot_chunk_gets_a_whole_prompt() -> None:
    bounds = Bounds(ceiling=POLICY.top_rung, ceiling_why="top", floor=1023,
                    floor_why="one whole prompt (these shards do not chunk prompts)")
    choice = choose([Rung(256, 0.001), Rung(512, 0.002)], bounds, POLICY, "test")
    assert choice.tokens == 1023 and choice.why.endswith(bounds.floor_why)


def test_choose_needs_a_measurement() -> None:
    with pytest.raises(ValueError, match="at least one"):
        choose([], OPEN, POLICY, "nothing measured")


rung_lists = st.lists(
    st.builds(Rung, st.sampled_from([2**k for k in range(8, 16)]),
              st.floats(1e-4, 2.0), st.integers(0, 2**24)),
    min_size=1, max_size=8, unique_by=lambda r: r.tokens,
).map(lambda rs: sorted(rs, key=lambda r: r.tokens))


@settings(max_examples=100, deadline=None)
@given(rungs=rung_lists, activation=st.sampled_from([0, 2**28, 2**32]),
       floor=st.sampled_from([0, 300, 5000]))
def test_the_choice_is_the_smallest_near_peak_rung_within_the_bounds(
    rungs: list[Rung], activation: int, floor: int
) -> None:
    bounds = Bounds(ceiling=2**15, ceiling_why="top", activation_bytes=activation,
                    logits_bytes_per_token=4096, floor=floor, floor_why="floor")
    choice = choose(rungs, bounds, POLICY, "test")
    memory = memory_bound(rungs, bounds)
    fit = [r for r in rungs
           if r.seconds <= POLICY.max_step_s and (memory is None or r.tokens <= memory)]
    pool = fit or [rungs[0]]
    peak = max(r.throughput for r in pool)
    near = [r.tokens for r in pool if r.throughput >= 0.9 * peak]
    assert choice.tokens == max(min(near), floor)
    assert choice.tokens >= floor


@settings(max_examples=100, deadline=None)
@given(overhead=st.floats(0.0, 0.2), rate=st.floats(1e3, 1e7),
       ceiling=st.integers(1, 2**16))
def test_the_ladder_ends_within_its_bounds(overhead: float, rate: float, ceiling: int) -> None:
    bounds = Bounds(ceiling=ceiling, ceiling_why="ceiling")
    rungs, _ = climb(saturating(overhead, rate), bounds)
    assert rungs and all(r.tokens <= ceiling for r in rungs)
    tokens = [r.tokens for r in rungs]
    assert tokens == sorted(set(tokens))
    # Every rung but the first was predicted within the step time and the budget.
    assert sum(r.seconds for r in rungs[:-1]) * POLICY.repeats <= POLICY.budget_s

"""Warmup's prefill ladder (shard/engine/prefill_ladder.py) on the tiny Llama: what it measures,
the bounds it hands the policy, and Warmup answering the budget it chose."""

from __future__ import annotations

import re

import pytest
import torch

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.engine.prefill_budget import LadderPolicy
from pytgi_shard.engine.prefill_ladder import (
    ladder_bounds,
    ladder_lengths,
    measure_prefill,
    resolve_prefill,
)
from pytgi_shard.engine.warmup import Limits
from pytgi_shard.errors import OutOfMemory
from tests.unit.shard.router_steps import Engines

# A ladder that stays cheap on a loaded CPU: its rungs, not its time, are what is tested.
QUICK = LadderPolicy(first_rung=64, top_rung=256, budget_s=60.0, max_step_s=30.0, repeats=1)


@pytest.mark.parametrize(
    ("tokens", "longest", "max_batch_size", "expected"),
    [
        (256, 255, 0, [255, 1]),
        (1024, 4000, 0, [512, 512]),
        (100, 4000, 0, [100]),
        (1024, 4000, 2, [512, 512]),
        (1024, 300, 2, [300, 300, 300, 124]),  # the caller's ceiling keeps this from happening
        (3000, 4000, 2, [1500, 1500]),
    ],
)
def test_a_rungs_prompts(tokens: int, longest: int, max_batch_size: int, expected: list[int]) -> None:
    assert ladder_lengths(tokens, longest, max_batch_size, 512) == expected


def test_the_ladder_measures_the_engines_own_prefills(engines: Engines) -> None:
    engine = engines()
    runner = engine.runner
    seen: list[tuple[int, int]] = []

    def run(batch: pb.Batch) -> None:
        seen.append((sum(len(r.input_ids) for r in batch.requests), runner.kv_cache.num_blocks))
        engine._run_warmup_batch(batch)

    limits = Limits(0, 0, 0, 0, 2000)
    choice = measure_prefill(runner, limits, run, True, QUICK)
    # 64 (once untimed, once timed), 128, 256: doubling up to the ladder's top, every rung in a
    # cache holding its blocks.
    tokens = [t for t, _ in seen]
    assert tokens == [64, 64, 128, 256]
    assert all(blocks >= t // runner.block_size + 1 for t, blocks in seen)
    assert choice.tokens in tokens
    assert "prefill throughput measured at 64/128/256 tokens" in choice.why
    assert runner.kv_cache.num_blocks == 1 and len(engine.cache) == 0


def test_the_kv_budget_and_batch_size_bound_the_ladder(engines: Engines) -> None:
    runner = engines().runner
    bounds = ladder_bounds(runner, Limits(0, 0, 0, 0, 700), True, LadderPolicy())
    assert (bounds.ceiling, bounds.ceiling_why) == (700, "the KV budget (700 tokens)")
    by_batch = ladder_bounds(runner, Limits(0, 100, 0, 3, 700), True, LadderPolicy())
    assert by_batch.ceiling == 300 and "--max-batch-size 3" in by_batch.ceiling_why
    # Off CUDA activations are not measured; a shard that cannot chunk needs a whole prompt.
    assert bounds.activation_bytes == 0 and bounds.floor == 0
    whole = ladder_bounds(runner, Limits(0, 100, 0, 0, 700), False, LadderPolicy())
    assert whole.floor == 100 and "do not chunk" in whole.floor_why


def test_a_rung_out_of_memory_stops_the_ladder_below_it(engines: Engines) -> None:
    engine = engines()

    def run(batch: pb.Batch) -> None:
        if sum(len(r.input_ids) for r in batch.requests) > 200:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        engine._run_warmup_batch(batch)

    choice = measure_prefill(engine.runner, Limits(0, 0, 0, 0, 2000), run, True, QUICK)
    assert choice.tokens in {64, 128}
    assert "a prefill of 256 tokens ran out of memory" in choice.why
    assert engine.runner.kv_cache.num_blocks == 1

    def never(batch: pb.Batch) -> None:
        raise MemoryError("simulated")

    with pytest.raises(OutOfMemory, match="--max-batch-prefill-tokens"):
        measure_prefill(engine.runner, Limits(0, 0, 0, 0, 2000), never, True, QUICK)


def test_a_budget_the_router_set_is_not_measured(engines: Engines) -> None:
    engine = engines()

    def run(batch: pb.Batch) -> None:
        raise AssertionError("measured a budget the router set")

    limits = Limits(300, 0, 0, 0, 2000)
    assert resolve_prefill(engine.runner, limits, run, True) == (limits, "")


def test_warmup_answers_the_budget_it_measured(engines: Engines) -> None:
    engine = engines()
    auto = engine.warmup(pb.WarmupRequest(max_batch_total_tokens=1024))
    rungs = re.search(r"measured at ([\d/]+) tokens", auto.prefill_sizing)
    assert rungs is not None
    measured = [int(t) for t in rungs[1].split("/")]
    assert auto.max_prefill_tokens in measured and max(measured) <= 1024
    assert f"{auto.max_prefill_tokens} is the smallest within 10%" in auto.prefill_sizing
    # A shard that chunks takes a prompt of the whole context, whatever the prefill budget.
    assert auto.max_input_tokens == auto.max_total_tokens - 1
    assert "the KV budget the router asked for (1024 tokens)" in auto.kv_sizing
    fixed = engine.warmup(pb.WarmupRequest(max_prefill_tokens=128, max_batch_total_tokens=2048))
    assert (fixed.max_prefill_tokens, fixed.prefill_sizing) == (128, "")

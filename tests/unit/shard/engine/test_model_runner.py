"""The model runner alone (shard/engine/model_runner.py): its KV cache, look-aheads and Warmup
sizing, driven without the Engine's RPCs where it can be."""

from __future__ import annotations

import pytest
import torch

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.attention.kv_cache import KVCache
from pytgi_shard.attention.metadata import AttentionMetadata
from pytgi_shard.engine.forward_timer import ForwardTimer
from pytgi_shard.engine.lookahead import Lookahead
from pytgi_shard.engine.model_runner import ModelRunner
from pytgi_shard.engine.step_inputs import ForwardInputs
from pytgi_shard.engine.warmup import WARMUP_BATCH_ID, Limits
from pytgi_shard.errors import OutOfMemory
from tests.unit.shard.router_steps import Engines


def _pending(runner: ModelRunner) -> None:
    """One look-ahead as the overlap scheduler leaves it between two steps."""
    logits = torch.zeros(1, runner.model.vocab_size)
    runner.lookaheads.add(Lookahead([7], logits, ForwardTimer(runner.model.device)))


def test_resize_replaces_the_cache_and_drops_the_lookaheads(engines: Engines) -> None:
    """A look-ahead wrote into the old cache: after a resize its logits mean nothing."""
    runner = engines().runner
    before = runner.kv_cache.num_blocks
    _pending(runner)
    runner.resize_kv_cache(before + 3)
    assert runner.kv_cache.num_blocks == before + 3
    assert len(runner.lookaheads) == 0
    runner.resize_kv_cache(before)


def test_a_failed_resize_keeps_block_zero_for_health(
    engines: Engines, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The old cache goes before the new one is allocated: when that fails, block 0 alone is
    left, and Health still runs its forward there."""
    runner = engines().runner
    before = runner.kv_cache.num_blocks
    allocate = runner.allocate_kv_cache

    def small_only(num_blocks: int) -> KVCache:
        if num_blocks > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return allocate(num_blocks)

    monkeypatch.setattr(runner, "allocate_kv_cache", small_only)
    with pytest.raises(torch.OutOfMemoryError):
        runner.resize_kv_cache(before)
    assert runner.kv_cache.num_blocks == 1
    runner.health()
    monkeypatch.undo()
    runner.resize_kv_cache(before)
    runner.health()


def test_forward_without_graphs_is_the_models(engines: Engines) -> None:
    runner = engines().runner
    zero = torch.zeros(1, dtype=torch.long)
    meta = AttentionMetadata.build([1], [0], [[0]], runner.block_size, runner.model.device)
    inputs = ForwardInputs(zero, zero, meta, None, zero)
    logits, timer, graphed = runner.forward(inputs)
    assert not graphed and timer.elapsed_ns() >= 0
    expected = runner.model.forward(zero, zero, runner.kv_cache, meta, None)
    torch.testing.assert_close(logits, expected)


def test_size_kv_cache_runs_the_warmup_batch_in_a_cache_of_its_size(engines: Engines) -> None:
    """The runner sizes around the caller's run of the warmup batch (the Engine's Prefill and
    Decode): the batch sees a cache holding its blocks, and block 0 alone is left after."""
    runner = engines().runner
    before = runner.kv_cache.num_blocks
    seen: list[tuple[int, int]] = []

    def run(batch: pb.Batch) -> None:
        _pending(runner)
        seen.append((batch.id, runner.kv_cache.num_blocks))

    limits = Limits(100, 60, 0, 0, 1000)
    size = runner.size_kv_cache(limits, run)
    blocks = 1 + sum(-(-(n + 1) // runner.block_size) for n in (60, 40))
    assert seen == [(WARMUP_BATCH_ID, blocks)]
    assert runner.kv_cache.num_blocks == 1 and len(runner.lookaheads) == 0
    assert size.num_blocks == -(-1000 // runner.block_size) + 1 and size.graph_buckets == ()
    runner.allocate_sized(size)
    assert runner.kv_cache.num_blocks == size.num_blocks
    runner.resize_kv_cache(before)


def test_an_oom_in_the_warmup_batch_names_the_flags(engines: Engines) -> None:
    runner = engines().runner
    before = runner.kv_cache.num_blocks

    def run(batch: pb.Batch) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    with pytest.raises(OutOfMemory, match="100 prefill tokens.*--max-batch-prefill-tokens"):
        runner.size_kv_cache(Limits(100, 60, 0, 0, 1000), run)
    assert runner.kv_cache.num_blocks == 1
    runner.resize_kv_cache(before)

"""Live LoRA loading on two tensor-parallel ranks (gloo, one process each), one device slot
(--max-loras 1): both ranks load two adapters at the wire indices the router would send, serve
one under the first (beside a base-model row), evict it for the second, unload the first, and
give the tokens and logprobs of one rank doing the same."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.service.startup import load_engine
from pytgi_shard.settings import ShardSettings
from tests.lora_adapters import write_adapter
from tests.unit.shard.engine.test_batch import batch_of, request
from tests.unit.shard.engine.test_engine import Run
from tests.unit.shard.lora.test_lora_two_ranks import PROMPTS, assert_like_one_rank, two_ranks


def _live_run(model: Path, sources: dict[str, Path], rank: int = 0, world_size: int = 1,
              port: int = 29500) -> Run:
    engine = load_engine(ShardSettings(model_path=model, block_size=4, rank=rank,
                                       world_size=world_size, master_port=port,
                                       lora_runtime_updates=True, max_loras=1,
                                       max_lora_rank=8))
    engine.warmup(pb.WarmupRequest(max_prefill_tokens=128, max_batch_total_tokens=1024))
    for index, (name, path) in enumerate(sources.items(), 1):
        engine.load_adapter(pb.LoadAdapterRequest(name=name, source=str(path), index=index))
    run = Run(engine)
    base, first, second = (request(10 + i, p, max_new=6, ignore_eos=True, adapter_index=i)
                           for i, p in enumerate(PROMPTS))
    run.finish(run.prefill(batch_of(first, base, batch_id=1)))
    run.finish(run.prefill(batch_of(second, batch_id=2)))  # evicts adapter 1 for adapter 2
    assert engine.adapters.evictions == 1, engine.adapters.evictions
    engine.unload_adapter(pb.UnloadAdapterRequest(index=1))
    assert list(engine.info().lora_adapters) == ["", "beta"]
    return run


def test_two_ranks_load_evict_and_unload_like_one(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    model = tiny_model("llama")
    sources = {
        "alpha": write_adapter(tmp_path / "alpha", model, rank=8, alpha=16, seed=7),
        "beta": write_adapter(tmp_path / "beta", model, rank=4, alpha=8, seed=8,
                              modules=("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj")),
    }
    ranks = two_ranks(_live_run, model, sources, tmp_path)
    assert_like_one_rank(ranks, _live_run(model, sources))

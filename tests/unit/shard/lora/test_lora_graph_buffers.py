"""LoRA through the decode graphs' buffers: each row's adapter slot is an input buffer of the
graph runner (shard/engine/decode_graphs.py), so a decode step of mixed adapters runs through the
bucketed path (here its eager padding, pad_eagerly: no GPU to capture on) and gives every request
its solo output; a later step without adapters leaves no adapter behind in the buffer."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.engine.decode_graphs import DecodeGraphRunner
from pytgi_shard.engine.engine import Engine
from pytgi_shard.lora.layer import lora_rows_of
from pytgi_shard.service.startup import load_engine
from pytgi_shard.settings import ShardSettings
from tests.lora_adapters import write_adapter
from tests.unit.shard.engine.test_batch import batch_of, request
from tests.unit.shard.engine.test_engine import Run, solo

PROMPTS = ([12, 40, 77, 9, 150, 33, 21], [5, 98, 61, 200, 14], [44, 17, 120, 63, 8, 91, 30, 11])
BLOCK = 4


@pytest.fixture(scope="module")
def engines(tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[Engine, Engine]]:
    """(plain, graphed): the same adapters; the second decodes through padded buckets."""
    root = tmp_path_factory.mktemp("lora_graphs")
    base = tiny_model("llama")
    spec = ",".join(
        f"{name}={write_adapter(root / name, base, rank=rank, alpha=16, seed=seed)}"
        for name, rank, seed in (("alpha", 8, 1), ("beta", 4, 2)))
    pair = []
    for _ in range(2):
        e = load_engine(ShardSettings(model_path=base, block_size=BLOCK, lora_adapters=spec))
        e.warmup(pb.WarmupRequest(max_prefill_tokens=128, max_batch_total_tokens=2048))
        pair.append(e)
    pair[1].runner.decode_graphs = DecodeGraphRunner(pair[1].model, (1, 2, 4, 8), 8, BLOCK,
                                                     pad_eagerly=True)
    yield pair[0], pair[1]


def lora_request(rid: int, prompt: list[int], adapter: int) -> pb.Request:
    return request(rid, prompt, max_new=6, ignore_eos=True, adapter_index=adapter)


def test_the_graph_runner_binds_the_models_lora_rows(engines: tuple[Engine, Engine]) -> None:
    _, graphed = engines
    runner = graphed.runner.decode_graphs
    assert runner is not None and runner._lora is lora_rows_of(graphed.model) is not None


def test_mixed_adapters_decode_through_the_buffers_as_alone(
        engines: tuple[Engine, Engine]) -> None:
    plain, graphed = engines
    reqs = [lora_request(10 + i, p, i) for i, p in enumerate(PROMPTS)]
    alone = {r.id: solo(plain, r) for r in reqs}
    run = Run(graphed)
    run.finish(run.prefill(batch_of(*reqs, batch_id=1)))
    for r in reqs:
        assert run.tokens[r.id] == alone[r.id].tokens[r.id], r.adapter_index
        torch.testing.assert_close(run.logprobs[r.id], alone[r.id].logprobs[r.id],
                                   rtol=1e-4, atol=1e-4)
    assert len({tuple(alone[r.id].tokens[r.id]) for r in reqs}) == 3  # the adapters matter
    # A base-only batch after it: the buffer's adapter slots were reset.
    base = [lora_request(30 + i, p, 0) for i, p in enumerate(PROMPTS)]
    run = Run(graphed)
    run.finish(run.prefill(batch_of(*base, batch_id=2)))
    for r in base:
        assert run.tokens[r.id] == solo(plain, r).tokens[r.id]


# --- capture and replay on a GPU (bench/gpu.sh's tests stage) ---------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_graphs_serve_mixed_adapters_as_without_graphs(
        tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    """On CUDA the adapted layers take the Triton kernels, the decode graphs are captured with
    adapters loaded, and a mixed batch replayed through them gives the tokens (and logprobs)
    of the same engine with its graphs dropped."""
    base = tiny_model("llama")
    spec = ",".join(f"{name}={write_adapter(tmp_path / name, base, rank=rank, alpha=16, seed=s)}"
                    for name, rank, s in (("alpha", 8, 1), ("beta", 4, 2)))
    gpu = load_engine(ShardSettings(model_path=base, block_size=BLOCK, dtype="float32",
                                    lora_adapters=spec, cuda_graphs=(1, 2, 4, 8)))
    gpu.warmup(pb.WarmupRequest(max_prefill_tokens=128, max_total_tokens=64,
                                max_batch_total_tokens=2048))
    runner = gpu.runner.decode_graphs
    assert runner is not None and runner.captured == (1, 2, 4, 8)
    assert {m.path for m in gpu.model.modules() if hasattr(m, "set_slot")} == {"triton"}
    reqs = [lora_request(50 + i, p, i) for i, p in enumerate(PROMPTS)]
    graphed = Run(gpu)
    graphed.finish(graphed.prefill(batch_of(*reqs, batch_id=60)))
    gpu.runner.decode_graphs = None
    eager = Run(gpu)
    eager.finish(eager.prefill(batch_of(*reqs, batch_id=61)))
    for r in reqs:
        assert graphed.tokens[r.id] == eager.tokens[r.id], r.adapter_index
        torch.testing.assert_close(graphed.logprobs[r.id], eager.logprobs[r.id],
                                   rtol=1e-4, atol=1e-4)
    assert len({tuple(eager.tokens[r.id]) for r in reqs}) == 3

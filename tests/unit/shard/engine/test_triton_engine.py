"""A tiny Llama served by the shard Engine with --attention triton gives the reference's tokens.

Under Triton's interpreter on CPU (tests/conftest.py), compiled on a GPU. Prefill, a second
prefill joining the running batch, and decode steps over small blocks, so sequences span several
blocks and the decode batch mixes block tables of different widths.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.service.startup import load_engine
from pytgi_shard.settings import ShardSettings
from tests.unit.shard.engine.test_batch import batch_of, request
from tests.unit.shard.engine.test_engine import Run, encode

pytest.importorskip("triton", reason="triton is not installed")

BLOCK = 4


def serve(model: Path, attention: str) -> Run:
    engine = load_engine(ShardSettings(model_path=model, block_size=BLOCK, attention=attention))
    engine.warmup(pb.WarmupRequest(max_prefill_tokens=32, max_batch_total_tokens=1024))
    run = Run(engine)
    prompts = ["The quick brown fox", "Hello", "Paged attention stores keys"]
    reqs = [request(i + 1, encode(engine, p), max_new=6, block_size=BLOCK)
            for i, p in enumerate(prompts)]
    cached = run.prefill(batch_of(*reqs[:2], batch_id=1))
    cached = run.decode(cached) if cached is not None else None
    cached = run.prefill(batch_of(reqs[2], batch_id=2), cached)
    run.finish(cached)
    return run


def test_triton_engine_matches_the_reference_greedy(tiny_model: Callable[..., Path]) -> None:
    model = tiny_model("llama")
    expected = serve(model, "reference")
    got = serve(model, "triton")
    assert got.engine.info().attention_impl == "triton"
    assert set(got.tokens) == {1, 2, 3}
    assert all(len(ids) == 6 for ids in expected.tokens.values())
    assert got.tokens == expected.tokens
    for rid, logprobs in expected.logprobs.items():
        torch.testing.assert_close(got.logprobs[rid], logprobs, atol=1e-4, rtol=1e-4)

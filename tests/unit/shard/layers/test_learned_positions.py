"""Issue 11 item 7: Warmup refuses a max_total_tokens beyond a learned position table (GPT-2 through
the transformers fallback), where positions past the table would fail mid-request (a device-side
assert on CUDA); rotary models (our Llama) have no such table and are not limited."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.errors import InvalidRequest
from pytgi_shard.service.startup import load_engine
from pytgi_shard.settings import ShardSettings


def test_warmup_refuses_more_tokens_than_gpt2_has_positions(
    tiny_model: Callable[..., Path],
) -> None:
    engine = load_engine(ShardSettings(model_path=tiny_model("gpt2"), block_size=16))
    model = engine.model
    assert model.learned_positions and model.max_position_embeddings == 256
    with pytest.raises(InvalidRequest, match=r"max_total_tokens \(300\) exceeds "
                                             r"max_position_embeddings \(256\) of gpt2"):
        engine.warmup(pb.WarmupRequest(max_prefill_tokens=64, max_input_tokens=32,
                                       max_total_tokens=300, max_batch_total_tokens=1024))
    response = engine.warmup(pb.WarmupRequest(max_prefill_tokens=64, max_input_tokens=32,
                                              max_total_tokens=256, max_batch_total_tokens=1024))
    assert response.max_total_tokens == 256


def test_rotary_llama_has_no_learned_positions(tiny_model: Callable[..., Path]) -> None:
    engine = load_engine(ShardSettings(model_path=tiny_model("llama"), block_size=16))
    assert not engine.model.learned_positions
    limit = engine.model.max_position_embeddings
    response = engine.warmup(pb.WarmupRequest(max_prefill_tokens=64, max_input_tokens=32,
                                              max_total_tokens=limit + 16,
                                              max_batch_total_tokens=2 * limit))
    assert response.max_total_tokens == limit + 16

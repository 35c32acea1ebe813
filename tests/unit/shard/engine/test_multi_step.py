"""Multi-step decode (shard/engine/multi_step.py): a Decode of k steps answers exactly what k
one-step Decodes answer, step for step (tokens, logprobs, texts, finish reasons, seeds), with
rows finishing mid-call (max tokens, a stop sequence, a grammar's end) left out of the later steps, and the same
batch left in the cache."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest

from pytgi_proto import generate_pb2 as pb
from pytgi_proto.contracts import DECODE_STEPS_LIMIT
from pytgi_shard.engine.engine import Engine
from pytgi_shard.engine.multi_step import decode_steps
from pytgi_shard.errors import InvalidRequest
from pytgi_shard.service.startup import load_engine
from pytgi_shard.settings import ShardSettings

BLOCK = 4


def _engine(model: Path, overlap: bool) -> Engine:
    engine = load_engine(ShardSettings(model_path=model, block_size=BLOCK, overlap=overlap))
    engine.warmup(pb.WarmupRequest(max_prefill_tokens=64, max_batch_total_tokens=1024))
    return engine


def _request(rid: int, prompt: list[int], max_new: int, first_block: int,
             **kw: object) -> pb.Request:
    constrained = "parameters" in kw and kw["parameters"].grammar  # type: ignore[attr-defined]
    """Blocks for the request's whole life (the router grows them ahead of a multi-step call)."""
    blocks = math.ceil((len(prompt) + max_new) / BLOCK)
    params = kw.pop("parameters", pb.NextTokenChooserParameters())
    return pb.Request(
        id=rid, input_ids=prompt, parameters=params,
        top_n_tokens=kw.pop("top_n", 0),  # type: ignore[arg-type]
        stopping_parameters=pb.StoppingCriteriaParameters(
            max_new_tokens=max_new, ignore_eos_token=not constrained,
            stop_sequences=list(kw.pop("stop", ())),  # type: ignore[call-overload]
        ),
        blocks=list(range(first_block, first_block + blocks)),
    )  # fmt: skip


def _batch() -> pb.Batch:
    sampled = pb.NextTokenChooserParameters(do_sample=True, temperature=0.8, top_k=20, seed=7)
    return pb.Batch(id=1, requests=[
        _request(1, [5, 6, 7, 8, 9], 3, 1),  # finishes by length in the first call
        _request(2, [10, 11, 12], 11, 4, parameters=sampled),
        _request(3, [13, 14, 15, 16, 17, 18, 19], 14, 9, top_n=2),
        _request(4, [20, 21], 9, 15, stop=["x"]),
        # Constrained: the shard's grammar matcher advances every step; its EOS may end it.
        _request(5, [22, 23, 24], 20, 18, parameters=pb.NextTokenChooserParameters(
            grammar="(ab|cd|[a-z ]){2,12}", grammar_type=pb.GRAMMAR_TYPE_REGEX)),
    ])  # fmt: skip


def _steps(engine: Engine, k: int) -> tuple[list[list[bytes]], list[int]]:
    """Prefill, then Decodes of `k` steps until every request finished: each step's
    Generations (serialised) and the batch's request ids after each call."""
    engine.clear(None)
    response = engine.prefill(pb.PrefillRequest(batch=_batch()))
    steps: list[list[bytes]] = [[g.SerializeToString() for g in response.generations]]
    sizes_seen: list[int] = []
    cached = response.batch if response.HasField("batch") else None
    while cached is not None:
        out = decode_steps(engine, pb.DecodeRequest(batches=[cached], max_steps=k))
        sizes = list(out.step_sizes) or [len(out.generations)]
        assert sum(sizes) == len(out.generations)
        assert len(sizes) <= k
        at = 0
        for size in sizes:
            steps.append([g.SerializeToString() for g in out.generations[at:at + size]])
            at += size
        sizes_seen.extend(sizes)
        cached = out.batch if out.HasField("batch") else None
        if cached is not None:
            assert engine.cache.get(cached.id).request_ids == list(cached.request_ids)
    return steps, sizes_seen


@pytest.mark.parametrize("overlap", [False, True])
def test_k_steps_per_call_answer_what_k_calls_answer(
    tiny_model: Callable[..., Path], overlap: bool
) -> None:
    engine = _engine(tiny_model("llama"), overlap)
    one, _ = _steps(engine, 1)
    for k in (2, 5, 8):
        many, sizes = _steps(engine, k)
        assert many == one, f"k={k} differs from one step per call"
    # Rows left mid-call: request 1 after its 2 decode steps, the rest later.
    assert sizes[:2] == [5, 5] and sizes[2] <= 4
    # Nothing left behind: no batch, no look-ahead.
    assert len(engine.cache) == 0
    assert len(engine.runner.lookaheads) == 0


def test_one_step_is_the_plain_decode(tiny_model: Callable[..., Path]) -> None:
    engine = _engine(tiny_model("llama"), False)
    response = engine.prefill(pb.PrefillRequest(batch=_batch()))
    out = decode_steps(engine, pb.DecodeRequest(batches=[response.batch], max_steps=1))
    assert not out.step_sizes and len(out.generations) == 5


def test_too_many_steps_are_refused(tiny_model: Callable[..., Path]) -> None:
    engine = _engine(tiny_model("llama"), False)
    response = engine.prefill(pb.PrefillRequest(batch=_batch()))
    with pytest.raises(InvalidRequest, match="max_steps"):
        decode_steps(engine, pb.DecodeRequest(batches=[response.batch],
                                              max_steps=DECODE_STEPS_LIMIT + 1))
    # Refused before touching the batch: it still decodes.
    out = decode_steps(engine, pb.DecodeRequest(batches=[response.batch], max_steps=2))
    assert list(out.step_sizes) == [5, 5]

"""The engine on tiny models, in-process (one rank, the real start-up path).

tests/integration/test_shard_grpc.py drives the same engine through real `pytgi-shard serve`
processes on two ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.engine.engine import Engine
from pytgi_shard.errors import BatchNotFound, InvalidRequest, OutOfMemory
from pytgi_shard.output.stopping import EOS_TOKEN, LENGTH, STOP_SEQUENCE
from pytgi_shard.service.startup import load_engine
from pytgi_shard.settings import ShardSettings
from tests.hf_reference import hf_greedy
from tests.unit.shard.engine.test_batch import batch_of, request


@pytest.fixture(scope="module")
def engines(tiny_model: Callable[..., Path]) -> Iterator[Callable[[str], Engine]]:
    built: dict[str, Engine] = {}

    def get(family: str) -> Engine:
        if family not in built:
            settings = ShardSettings(model_path=tiny_model(family), block_size=16)
            engine = load_engine(settings)
            engine.warmup(pb.WarmupRequest(max_prefill_tokens=256, max_batch_total_tokens=4096))
            built[family] = engine
        return built[family]

    yield get


def encode(engine: Engine, text: str) -> list[int]:
    tok = Tokenizer.from_file(str(engine.settings.model_path / "tokenizer.json"))
    return tok.encode(text).ids


class Run:
    """Drives an engine like the router: prefill, decode until done, collecting generations."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tokens: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[float]] = {}
        self.finals: dict[int, pb.GeneratedText] = {}
        self.generations: dict[int, list[pb.Generation]] = {}

    def absorb(self, generations: list[pb.Generation]) -> None:
        for g in generations:
            self.tokens.setdefault(g.request_id, []).extend(g.tokens.ids)
            self.logprobs.setdefault(g.request_id, []).extend(g.tokens.logprobs)
            self.generations.setdefault(g.request_id, []).append(g)
            if g.HasField("generated_text"):
                self.finals[g.request_id] = g.generated_text

    def prefill(
        self, batch: pb.Batch, cached: pb.CachedBatch | None = None
    ) -> pb.CachedBatch | None:
        req = pb.PrefillRequest(batch=batch)
        if cached is not None:
            req.cached_batch.CopyFrom(cached)
        response = self.engine.prefill(req)
        self.absorb(list(response.generations))
        return response.batch if response.HasField("batch") else None

    def decode(self, *cached: pb.CachedBatch) -> pb.CachedBatch | None:
        response = self.engine.decode(pb.DecodeRequest(batches=cached))
        self.absorb(list(response.generations))
        return response.batch if response.HasField("batch") else None

    def finish(self, cached: pb.CachedBatch | None) -> None:
        while cached is not None:
            cached = self.decode(cached)


def solo(engine: Engine, req: pb.Request) -> Run:
    run = Run(engine)
    run.finish(run.prefill(batch_of(req, batch_id=1000 + req.id)))
    return run


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gpt2"])
def test_greedy_matches_transformers_generate(
    engines: Callable[[str], Engine], family: str
) -> None:
    engine = engines(family)
    prompt = encode(engine, "The quick brown fox")
    expected, expected_lps = hf_greedy(engine.settings.model_path, prompt, 12)
    run = solo(engine, request(1, prompt, max_new=12, block_size=16))
    assert run.tokens[1] == expected
    torch.testing.assert_close(run.logprobs[1], expected_lps, rtol=1e-4, atol=1e-4)
    final = run.finals[1]
    assert final.generated_tokens == len(expected)
    assert final.finish_reason == (EOS_TOKEN if len(expected) < 12 else LENGTH)
    assert not final.HasField("seed")


def test_prefill_logprobs_match_the_model_and_first_is_nan(
    engines: Callable[[str], Engine],
) -> None:
    from transformers import AutoModelForCausalLM

    engine = engines("llama")
    prompt = encode(engine, "Hello world! How are you")
    run = solo(engine, request(1, prompt, max_new=1, block_size=16, prefill_logprobs=True))
    prefill = run.generations[1][0].prefill_tokens
    assert list(prefill.ids) == prompt
    assert math.isnan(prefill.logprobs[0]) and prefill.is_special[0]
    hf = AutoModelForCausalLM.from_pretrained(engine.settings.model_path, torch_dtype=torch.float32)
    logits = hf(torch.tensor([prompt])).logits[0]
    expected = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1), prompt[1:]]
    torch.testing.assert_close(list(prefill.logprobs[1:]), expected.tolist(), rtol=1e-4, atol=1e-4)


MIXED = [
    dict(),
    dict(
        parameters=pb.NextTokenChooserParameters(do_sample=True, seed=7, temperature=0.8, top_k=20)
    ),
    dict(parameters=pb.NextTokenChooserParameters(repetition_penalty=1.5, frequency_penalty=0.5)),
    dict(top_n_tokens=3, parameters=pb.NextTokenChooserParameters(top_p=0.8, seed=3)),
    dict(parameters=pb.NextTokenChooserParameters(typical_p=0.7, watermark=True, seed=11)),
]


def test_concatenate_and_filter_give_every_request_its_solo_tokens(
    engines: Callable[[str], Engine],
) -> None:
    engine = engines("llama")
    texts = ["The quick", "To be, or not", "Hello", "Paged attention stores", "def main():"]
    reqs = [
        request(i, encode(engine, t), max_new=6 + i, block_size=16, ignore_eos=True, **MIXED[i])
        for i, t in enumerate(texts)
    ]
    alone = {r.id: solo(engine, r) for r in reqs}
    run = Run(engine)
    a = run.prefill(batch_of(*reqs[:2], batch_id=1))
    assert a is not None
    a = run.decode(a)
    merged = run.prefill(batch_of(*reqs[2:], batch_id=2), cached=a)
    assert merged is not None and merged.id == 1 and list(merged.request_ids) == [0, 1, 2, 3, 4]
    merged = run.decode(merged)
    assert merged is not None
    kept = engine.filter(merged.id, [0, 2, 3, 4])
    assert kept is not None and list(kept.request_ids) == [0, 2, 3, 4]
    run.finish(run.decode(kept))
    for r in reqs:
        if r.id == 1:
            assert run.tokens[1] == alone[1].tokens[1][: len(run.tokens[1])]
            continue
        assert run.tokens[r.id] == alone[r.id].tokens[r.id]
        torch.testing.assert_close(
            run.logprobs[r.id], alone[r.id].logprobs[r.id], rtol=1e-4, atol=1e-4
        )
        assert run.finals[r.id].text == alone[r.id].finals[r.id].text
    assert all(len(g.top_tokens) == 1 and len(g.top_tokens[0].ids) >= 3 for g in run.generations[3])
    assert run.finals[0].finish_reason == LENGTH


def test_decode_of_several_cached_batches_concatenates_them(
    engines: Callable[[str], Engine],
) -> None:
    engine = engines("qwen2")
    reqs = [request(i, encode(engine, t), max_new=5, block_size=16, ignore_eos=True)
            for i, t in enumerate(["Hello world", "Unicode: café"])]  # fmt: skip
    alone = {r.id: solo(engine, r).tokens[r.id] for r in reqs}
    run = Run(engine)
    a = run.prefill(batch_of(reqs[0], batch_id=1))
    b = run.prefill(batch_of(reqs[1], batch_id=2))
    assert a is not None and b is not None
    merged = run.decode(a, b)
    assert merged is not None and merged.id == 1
    with pytest.raises(BatchNotFound):
        engine.filter(2, [1])
    run.finish(merged)
    assert run.tokens == alone


def test_seeded_sampling_is_reproducible(engines: Callable[[str], Engine]) -> None:
    engine = engines("mistral")
    prompt = encode(engine, "Continuous batching")
    params = pb.NextTokenChooserParameters(do_sample=True, seed=1234, temperature=1.5)
    first = solo(
        engine, request(1, prompt, max_new=10, block_size=16, ignore_eos=True, parameters=params)
    )
    again = solo(
        engine, request(2, prompt, max_new=10, block_size=16, ignore_eos=True, parameters=params)
    )
    params.seed = 99
    other = solo(
        engine, request(3, prompt, max_new=10, block_size=16, ignore_eos=True, parameters=params)
    )
    assert first.tokens[1] == again.tokens[2] != other.tokens[3]
    assert first.finals[1].seed == 1234


def test_eos_and_stop_sequences_end_requests(engines: Callable[[str], Engine]) -> None:
    engine = engines("llama")
    prompt = encode(engine, "To be, or not to be")
    free = solo(engine, request(1, prompt, max_new=8, block_size=16, ignore_eos=True))
    tokens, texts = free.tokens[1], [g.tokens.texts[0] for g in free.generations[1]]
    # A stop sequence that ends inside the 4th token's text.
    text_to_4 = "".join(texts[:4])
    assert texts[3], "the 4th token must produce text for this test"
    stopped = solo(
        engine, request(2, prompt, max_new=8, block_size=16, ignore_eos=True, stop=[text_to_4[-2:]])
    )
    final = stopped.finals[2]
    assert final.finish_reason == STOP_SEQUENCE and final.generated_tokens <= 4
    assert text_to_4[-2:] in final.text
    # EOS: make the 3rd generated token an EOS id of this engine.
    saved = engine.detokenizer.eos_ids
    engine.detokenizer.eos_ids = frozenset({tokens[2]})
    try:
        eos = solo(engine, request(3, prompt, max_new=8, block_size=16))
        ignored = solo(engine, request(4, prompt, max_new=8, block_size=16, ignore_eos=True))
    finally:
        engine.detokenizer.eos_ids = saved
    assert eos.finals[3].finish_reason == EOS_TOKEN
    assert eos.tokens[3] == tokens[: tokens.index(tokens[2]) + 1]
    assert ignored.finals[4].finish_reason == LENGTH and ignored.tokens[4] == tokens


def test_a_failing_step_drops_its_batch_and_the_engine_keeps_serving(
    engines: Callable[[str], Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = engines("llama")
    prompt = encode(engine, "Hello")
    run = Run(engine)
    cached = run.prefill(batch_of(request(1, prompt, max_new=5, block_size=16), batch_id=5))
    assert cached is not None
    monkeypatch.setattr(engine.model, "forward", _raise)
    with pytest.raises(RuntimeError, match="injected"):
        engine.decode(pb.DecodeRequest(batches=[cached]))
    monkeypatch.undo()
    with pytest.raises(BatchNotFound):
        engine.decode(pb.DecodeRequest(batches=[cached]))
    assert solo(engine, request(2, prompt, max_new=3, block_size=16)).finals[2].generated_tokens


def _raise(*args: object, **kwargs: object) -> torch.Tensor:
    raise RuntimeError("injected failure")


def test_bad_calls_leave_the_cache_intact(engines: Callable[[str], Engine]) -> None:
    engine = engines("llama")
    prompt = encode(engine, "Hello")
    run = Run(engine)
    cached = run.prefill(batch_of(request(1, prompt, max_new=5, block_size=16), batch_id=8))
    assert cached is not None
    with pytest.raises(InvalidRequest, match="already in batch 8"):
        run.prefill(batch_of(request(1, prompt, block_size=16), batch_id=9), cached=cached)
    with pytest.raises(InvalidRequest, match="already exists"):
        run.prefill(batch_of(request(2, prompt, block_size=16), batch_id=8))
    with pytest.raises(BatchNotFound):
        engine.decode(pb.DecodeRequest(batches=[cached, pb.CachedBatch(id=77)]))
    with pytest.raises(InvalidRequest, match="not in batch"):
        engine.filter(8, [1, 2])
    run.finish(cached)
    assert run.finals[1].generated_tokens == 5
    engine.clear(None)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_health_runs_a_forward_in_block_zero(
    engines: Callable[[str], Engine], family: str
) -> None:
    """Health writes the one token's keys and values into reserved block 0 of every layer (a
    real forward ran) and leaves every other block, which may hold live requests, untouched."""
    engine = engines(family)
    cache = engine.runner.kv_cache
    for layer in cache.keys + cache.values:
        layer[0].zero_()
        layer[1:].normal_()
    others = [layer[1:].clone() for layer in cache.keys + cache.values]
    engine.health()
    for layer, before in zip(cache.keys + cache.values, others, strict=True):
        assert bool(layer[0, 0].ne(0).any()), "no key/value written into block 0, slot 0"
        assert bool(layer[0, 1:].eq(0).all())
        assert torch.equal(layer[1:], before)
    for layer in cache.keys + cache.values:
        layer.zero_()


def test_warmup_sizes_the_cpu_cache_from_the_requested_budget(
    engines: Callable[[str], Engine],
) -> None:
    engine = engines("llama")
    response = engine.warmup(
        pb.WarmupRequest(max_prefill_tokens=100, max_input_tokens=60, max_batch_total_tokens=1000)
    )
    assert response.num_blocks == math.ceil(1000 / 16) + 1 == engine.runner.kv_cache.num_blocks
    assert response.max_supported_total_tokens == (response.num_blocks - 1) * 16
    assert response.max_input_tokens == 60 and response.block_size == 16
    assert response.max_total_tokens == 256  # the model's context, below the capacity
    auto = engine.warmup(pb.WarmupRequest(max_prefill_tokens=100, max_batch_total_tokens=64))
    assert auto.max_total_tokens == 64 and auto.max_input_tokens == 63
    # Terabytes of KV: a clear error naming the flags, and the engine still works.
    with pytest.raises(OutOfMemory, match="--max-batch-prefill-tokens"):
        engine.warmup(pb.WarmupRequest(max_prefill_tokens=100, max_batch_total_tokens=2**32 - 1))
    assert engine.runner.kv_cache.num_blocks == 1
    engine.health()
    engine.warmup(pb.WarmupRequest(max_prefill_tokens=256, max_batch_total_tokens=4096))

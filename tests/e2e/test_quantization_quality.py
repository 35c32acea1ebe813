"""Issue 17's quality proof for the quantize-on-load modes: the perplexity of the trained demo
model (launcher/demo_model) on held-out Shakespeare, from the prompt logprobs pytgi computes
(decoder_input_details), against float32: bitsandbytes and eetq within 1%, fp8 within 2%,
bitsandbytes-nf4 within 5%, bitsandbytes-fp4 within 8%; and the same for issue 29's FP8 KV cache
(--kv-cache-dtype): fp8_e4m3fn and fp8_e5m2 within 1% (measured: -0.06% and +0.13%).

Through the server, once: `pytgi-launcher --quantize SERVED` serves the prompt logprobs over
HTTP, and they equal those of the shard's engine loaded in this process with the same
`--quantize` (pytgi_shard.service.startup.load_engine, the start-up path every `pytgi-shard serve` runs,
then the same Prefill with prefill_logprobs). Float32 and every mode are then measured through
that in-process engine: each launcher start cost ~5-10 s on 2 cores, and a mode changes which
weight class the loader builds, not the serving path around it. (Until this change every mode
had its own launcher start; the bounds and the text are the same.)

The text (shakespeare_heldout.txt, public domain) is the end of Hamlet from "Exchange forgiveness
with me, noble Hamlet" and the end of Macbeth from Malcolm's "I would the friends we miss were safe
arriv'd": both inside the last 2% of their play's tokens, which deploy/demo_model/train.py holds
out of training (launcher/demo_model/TRAINING.md, "Corpus"); the First Folio texts the model
never saw either. 1,844 tokens, sent as 10 requests of at most 200 (the model's context is 256).
"""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.engine.engine import Engine
from pytgi_shard.service.startup import load_engine
from pytgi_shard.settings import ShardSettings
from tests.launcher_process import Launcher

ROOT = Path(__file__).resolve().parents[2]
TEXT = Path(__file__).with_name("shakespeare_heldout.txt")
TOKENIZER = ROOT / "launcher" / "demo_model" / "tokenizer.json"
DEMO_MODEL = TOKENIZER.parent
CHUNK_TOKENS = 200
BLOCK = 16
# The mode served through pytgi-launcher: a bitsandbytes one, so the launcher's shard process
# imports and runs the optional library too; with an FP8 KV cache, so --kv-cache-dtype's path
# from the launcher's flag to the shard's cache is served in the same start.
SERVED = "bitsandbytes-nf4"
SERVED_KV = "fp8_e4m3fn"
# Largest perplexity increase over float32 allowed per mode (issue 17).
BOUNDS = {
    "bitsandbytes": 0.01,
    "eetq": 0.01,
    "fp8": 0.02,
    "bitsandbytes-nf4": 0.05,
    "bitsandbytes-fp4": 0.08,
}
# The same for the KV cache's FP8 formats, the weights in float32.
KV_BOUNDS = {"fp8_e4m3fn": 0.01, "fp8_e5m2": 0.01}


def chunks(text: str, tokenizer: Tokenizer, limit: int) -> list[str]:
    """Whole lines, as many as fit in `limit` tokens per chunk."""
    out, current = [], ""
    for line in text.splitlines(keepends=True):
        if current and len(tokenizer.encode(current + line).ids) > limit:
            out.append(current)
            current = ""
        current += line
    return [*out, current]


def served_prompts(url: str, texts: list[str]) -> list[tuple[list[int], list[float]]]:
    """Each text's prompt token ids and, after the first, their logprobs served over HTTP."""
    out = []
    with httpx.Client(base_url=url, timeout=120) as client:
        for text in texts:
            response = client.post("/generate", json={"inputs": text, "parameters": {
                "max_new_tokens": 1, "details": True, "decoder_input_details": True}})  # fmt: skip
            response.raise_for_status()
            prefill = response.json()["details"]["prefill"]
            out.append(([t["id"] for t in prefill], [t["logprob"] for t in prefill[1:]]))
    return out


def load(mode: str | None, kv_cache_dtype: str | None = None) -> Engine:
    """The demo model as a shard loads it for `--quantize mode` (None: float32 on the CPU) and
    `--kv-cache-dtype kv_cache_dtype` (None: the cache in the model's dtype)."""
    engine = load_engine(ShardSettings(model_path=DEMO_MODEL, quantize=mode, block_size=BLOCK,
                                       kv_cache_dtype=kv_cache_dtype))
    engine.warmup(pb.WarmupRequest(max_prefill_tokens=256, max_batch_total_tokens=1024))
    assert engine.settings.quantize == (mode or "")
    return engine


def engine_logprobs(engine: Engine, prompts: list[list[int]]) -> list[list[float]]:
    """Each prompt's logprobs after its first token, from a one-request Prefill as the router
    sends it (decoder_input_details: prefill_logprobs; one new token, so nothing stays cached)."""
    out = []
    for rid, ids in enumerate(prompts):
        blocks = list(range(1, 2 + len(ids) // BLOCK))
        request = pb.Request(
            id=rid, input_ids=ids, prefill_logprobs=True, blocks=blocks,
            stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=1),
        )  # fmt: skip
        response = engine.prefill(pb.PrefillRequest(batch=pb.Batch(id=rid, requests=[request],
                                                                    size=1)))
        assert not response.HasField("batch")
        [generation] = response.generations
        assert list(generation.prefill_tokens.ids) == ids
        out.append(list(generation.prefill_tokens.logprobs[1:]))
    return out


def perplexity(logprobs: list[list[float]]) -> float:
    count = sum(len(x) for x in logprobs)
    assert count > 1800
    return math.exp(-sum(sum(x) for x in logprobs) / count)


def engine_perplexity(
    mode: str | None, prompts: list[list[int]], kv_cache_dtype: str | None = None
) -> float:
    return perplexity(engine_logprobs(load(mode, kv_cache_dtype), prompts))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    return [tokenizer.encode(text).ids for text in chunks(TEXT.read_text(), tokenizer,
                                                          CHUNK_TOKENS)]


@pytest.fixture(scope="module")
def float_perplexity(prompts: list[list[int]]) -> float:
    value = engine_perplexity(None, prompts)
    # The demo model's validation loss is 4.11 nats/token (TRAINING.md): e^4.11 = 61.
    assert 40 < value < 90
    return value


def test_the_launcher_serves_the_engine_logprobs() -> None:
    """`pytgi-launcher --quantize SERVED --kv-cache-dtype SERVED_KV`: the prompt logprobs over
    HTTP are the in-process engine's, token for token, so the per-mode numbers below are the
    served ones."""
    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    texts = chunks(TEXT.read_text(), tokenizer, CHUNK_TOKENS)
    launcher = Launcher("--quantize", SERVED, "--kv-cache-dtype", SERVED_KV)
    try:
        launcher.wait_ready()
        info = httpx.get(f"{launcher.url}/info", timeout=30).json()
        assert info.get("quantize") == SERVED, info
        served = served_prompts(launcher.url, texts)
    finally:
        launcher.close()
    assert [ids for ids, _ in served] == [tokenizer.encode(text).ids for text in texts]
    ours = engine_logprobs(load(SERVED, SERVED_KV), [ids for ids, _ in served])
    for (_, logprobs), expected in zip(served, ours, strict=True):
        assert logprobs == pytest.approx(expected, abs=1e-4)
    assert perplexity([x for _, x in served]) == pytest.approx(perplexity(ours), rel=1e-5)


@pytest.mark.parametrize("mode", list(BOUNDS))
def test_quantized_perplexity_stays_near_float32(
    mode: str, prompts: list[list[int]], float_perplexity: float
) -> None:
    value = engine_perplexity(mode, prompts)
    increase = value / float_perplexity - 1
    print(f"{mode}: perplexity {value:.3f} vs float32 {float_perplexity:.3f} ({increase:+.3%})")
    assert increase <= BOUNDS[mode], f"{mode}: {increase:+.3%} > {BOUNDS[mode]:.0%}"


@pytest.mark.parametrize("kv_cache_dtype", list(KV_BOUNDS))
def test_fp8_kv_cache_perplexity_stays_near_float32(
    kv_cache_dtype: str, prompts: list[list[int]], float_perplexity: float
) -> None:
    value = engine_perplexity(None, prompts, kv_cache_dtype)
    increase = value / float_perplexity - 1
    print(f"KV cache {kv_cache_dtype}: perplexity {value:.3f} vs float32 {float_perplexity:.3f} "
          f"({increase:+.3%})")
    # The cache did round (a float32 cache would give the float32 value to the last digit).
    assert value != float_perplexity
    assert increase <= KV_BOUNDS[kv_cache_dtype], f"{kv_cache_dtype}: {increase:+.3%}"

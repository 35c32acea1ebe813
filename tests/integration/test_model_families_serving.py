"""Every architecture in the registry served for real over gRPC on one rank, driven by the
router's core (Infer): greedy tokens and their logprobs equal to transformers' `generate` on the
same tiny random checkpoint (tests/tiny_models.py).

Two prompts run batched: one across three KV blocks and longer than any family's sliding window,
one shorter that still crosses a block boundary. The unit tests compare logits in-process
(tests/unit/shard/models/test_model_families.py, test_models_gpt.py); this is the served path: config.json
read by the shard's start-up (load_engine), warmup, the paged cache sized from the model, prefill
and decode steps over gRPC, sampling on the shard. The shard's gRPC server runs in this process
(start_server, what `pytgi-shard serve` runs after load_engine), which saves a process start per
architecture (~2 s on 2 cores); the `pytgi-shard serve` processes themselves, on two ranks with
the weights sliced per rank at load, serve every architecture with the same prompts and checks in
tests/e2e/test_model_families_launcher.py, through `pytgi-launcher --num-shard 2`, whose router
drives the same Infer over the same gRPC.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from pytgi_proto.parameters import neutral_sampling
from pytgi_router.core.infer import Infer, InferSettings
from pytgi_router.core.request import StoppingParameters, ValidRequest
from pytgi_router.core.request_stream import Token
from pytgi_router.core.shard_client import ShardClient
from pytgi_router.metrics import Metrics
from pytgi_shard.models import MODELS
from pytgi_shard.service.server import start_server
from pytgi_shard.service.startup import load_engine, peer_urls
from pytgi_shard.settings import ShardSettings
from tests.hf_reference import hf_greedy
from tests.tiny_models import EOS, FALLBACK, FAMILIES, build_model
from tests.vision_models import VISION_FAMILIES

BLOCK = 16  # the shard's default --block-size
TEXTS = [
    "Paged attention stores keys and values in fixed-size blocks of the cache, and continuous "
    "batching adds new requests between decode steps. The quick brown fox",
    "To be, or not to be, that is the question: def main():",
]
MAX_NEW = 10
# Random matrices large enough that attention is sharp: served without rotary positions, ALiBi or
# a window, the tokens change (tests/tiny_models.py's default leaves attention near uniform).
STD = 0.3


def test_every_registered_architecture_has_a_tiny_model() -> None:
    """Adding an architecture to the registry means adding its tiny model, so it is served here
    (a vision-language one: in tests/vision_models.py, served with images by
    test_qwen2_vl_serving.py)."""
    assert set(VISION_FAMILIES) <= set(MODELS)
    assert set(MODELS) - set(VISION_FAMILIES) <= set(FAMILIES) - set(FALLBACK)


# (model, prompts, transformers' greedy tokens and their logprobs per prompt)
Case = tuple[Path, list[list[int]], list[tuple[list[int], list[float]]]]


def case_of(family: str, root: Path) -> Case:
    """family's model built under `root`, its prompts, transformers' greedy tokens for each."""
    path = build_model(root / family, family, std=STD)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    prompts = [tokenizer.encode(text).ids for text in TEXTS]
    window = FAMILIES[family].get("sliding_window") or 0
    assert len(prompts[0]) > 2 * BLOCK and len(prompts[0]) > window
    assert len(prompts[1]) > BLOCK
    return path, prompts, [hf_greedy(path, p, MAX_NEW) for p in prompts]


def valid(prompt: list[int]) -> ValidRequest:
    return ValidRequest(
        inputs="", input_ids=prompt, truncate=len(prompt), sampling=neutral_sampling(),
        stopping=StoppingParameters(max_new_tokens=MAX_NEW, ignore_eos_token=True),
    )


async def tokens_of(infer: Infer, prompt: list[int]) -> tuple[list[int], list[float]]:
    """The served greedy tokens and the logprob the shards report for each."""
    events = [e async for e in infer.submit(valid(prompt)) if isinstance(e, Token)]
    return [e.token.id for e in events], [e.token.logprob for e in events]


async def serve(url: str, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """Both prompts at once (one batch), through the router's scheduler."""
    settings = InferSettings(max_input_tokens=100, max_total_tokens=128)
    client = await ShardClient.connect(url)
    infer = Infer(client, settings, Metrics())
    try:
        await infer.start()
        return list(await asyncio.gather(*(tokens_of(infer, p) for p in prompts)))
    finally:
        await infer.stop()
        await client.close()


async def serve_one_rank(
    model: Path, socket_dir: Path, prompts: list[list[int]]
) -> list[tuple[list[int], list[float]]]:
    """`pytgi-shard serve`'s start-up and gRPC server on one rank in this process, then `serve`."""
    settings = ShardSettings(model_path=model, uds_path=str(socket_dir / "s"))
    engine = load_engine(settings)
    try:
        running = await start_server(settings, engine, peer_urls(settings, engine.dist), [])
        try:
            return await serve(settings.uds_url(0), prompts)
        finally:
            await running.stop(settings, 0)
    finally:
        engine.dist.close()


def same_greedy(got: list[int], expected: list[int], eos: int) -> bool:
    """transformers' generate stops at EOS where the served request (ignore_eos) goes on: the
    tokens up to it must agree."""
    if len(expected) < MAX_NEW:
        assert expected[-1] == eos
    return got[: len(expected)] == expected and len(got) == MAX_NEW


@pytest.mark.parametrize(
    "family", sorted(set(MODELS) - set(VISION_FAMILIES))  # VLMs: test_qwen2_vl_serving.py
)
def test_served_greedy_tokens_equal_transformers(tmp_path: Path, family: str) -> None:
    path, prompts, expected = case_of(family, tmp_path)
    eos = Tokenizer.from_file(str(path / "tokenizer.json")).token_to_id(EOS)
    # Unix socket paths must stay short (~107 bytes): not under pytest's deep tmp_path.
    socket_dir = Path(tempfile.mkdtemp(prefix="pytgi-f-", dir="/tmp"))
    try:
        got = asyncio.run(serve_one_rank(path, socket_dir, prompts))
    finally:
        shutil.rmtree(socket_dir, ignore_errors=True)
    for (tokens, logprobs), (want, want_logprobs) in zip(got, expected, strict=True):
        assert same_greedy(tokens, want, eos), (family, tokens, want)
        # The logits behind them agree too (fp32): each token's logprob under the raw logits.
        shared = len(want_logprobs)
        assert logprobs[:shared] == pytest.approx(want_logprobs, abs=1e-3), family

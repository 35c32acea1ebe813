"""Prefix caching, chunked prefill and KV on demand with preemption change when tokens are computed,
never which: through the router's core (Infer) and real shard processes, greedy tokens equal
transformers' `generate` with caching on and off, prompts in chunks of 1, 7, 16 and 64 tokens, and
a KV budget small enough that requests are preempted and resumed — on Llama and on Qwen2 with a
sliding window, on 1 and 2 ranks."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from pytgi_proto.parameters import neutral_sampling
from pytgi_router.core.infer import Infer, InferSettings
from pytgi_router.core.request import StoppingParameters, ValidRequest
from pytgi_router.core.request_stream import End, Token
from pytgi_router.core.shard_client import ShardClient
from pytgi_router.metrics import Metrics
from tests.hf_reference import hf_greedy
from tests.shard_process import ShardProcesses, start_shards

# A shared preamble (several 16-token blocks) so that later requests find it cached.
PREAMBLE = "Paged attention stores keys and values in fixed-size blocks of the cache. "
SUFFIXES = [
    "The quick brown fox", "To be, or not to be", "Continuous batching adds",
    "Numbers: 0 1 2 3 4 5", "def main():",
]
MAX_NEW = 24
# KV budgets in tokens: ROOMY holds every request at once; in TIGHT (8 blocks of 16) four
# requests of ~48 + 24 tokens must take turns, even sharing their cached preamble.
ROOMY, TIGHT = 4096, 128
# A family only the transformers fallback serves (tests/tiny_models.py).
FALLBACK = "phi"
# (prefix caching, chunk size = max_batch_prefill_tokens, KV budget) on one rank, and on two.
# The ranks are parametrized apart from the rest so that pytest keeps one shard group per model
# and rank count (a tuple with the ranks in it made a new group for every case: ~15 s each).
ONE_RANK = [
    (caching, chunk, budget)
    for caching in (True, False)
    for chunk in (1, 7, 16, 64)
    for budget in (ROOMY, TIGHT)
]
TWO_RANKS = [(True, 7, TIGHT), (False, 64, ROOMY), (True, 16, ROOMY)]


def sliding_qwen2(path: Path) -> Path:
    """The tiny Qwen2 with a 12-token sliding window on its second layer (the first attends to
    everything): prompts here are longer than the window."""
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    config.update(use_sliding_window=True, sliding_window=12, max_window_layers=1, layer_types=None)
    config_path.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module", params=["llama", "qwen2-sliding", "phi-fallback"])
def model(request: pytest.FixtureRequest, tiny_model: Callable[..., Path],
          tmp_path_factory: pytest.TempPathFactory) -> Path:
    if request.param == "llama":
        return tiny_model("llama")
    if request.param == "phi-fallback":
        # Served through transformers over the same paged cache: it gets all three too.
        return tiny_model(FALLBACK)
    from tests.tiny_models import build_model

    return sliding_qwen2(build_model(tmp_path_factory.mktemp("qwen2") / "m", "qwen2"))


@pytest.fixture(scope="module")
def prompts(model: Path) -> list[list[int]]:
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    return [tokenizer.encode(PREAMBLE + s).ids for s in SUFFIXES]


@pytest.fixture(scope="module")
def expected(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    return [hf_greedy(model, p, MAX_NEW)[0] for p in prompts]


@pytest.fixture(scope="module")
def shards(request: pytest.FixtureRequest, model: Path) -> Iterator[ShardProcesses]:
    """`request.param` ranks (parametrized indirectly by the test)."""
    if request.param > 1 and model.name == FALLBACK:
        pytest.skip("the transformers fallback serves one shard")
    with start_shards(model, world_size=request.param) as processes:
        yield processes


def valid(prompt: list[int]) -> ValidRequest:
    return ValidRequest(
        inputs="", input_ids=prompt, truncate=len(prompt), sampling=neutral_sampling(),
        stopping=StoppingParameters(max_new_tokens=MAX_NEW, ignore_eos_token=True),
    )


async def tokens_of(infer: Infer, prompt: list[int]) -> list[int]:
    ids: list[int] = []
    async for event in infer.submit(valid(prompt)):
        if isinstance(event, Token):
            ids.append(event.token.id)
            if isinstance(event, End):
                assert event.generated_tokens == len(ids)
    return ids


async def serve(
    shards: ShardProcesses, prompts: list[list[int]], caching: bool, chunk: int, budget: int
) -> tuple[list[list[int]], Metrics]:
    """The first prompt alone (it fills the prefix cache), then the others at once."""
    settings = InferSettings(
        max_batch_prefill_tokens=chunk, max_batch_total_tokens=budget, max_input_tokens=100,
        max_total_tokens=128, prefix_caching=caching,
    )
    client = await ShardClient.connect(shards.urls[0])
    metrics = Metrics()
    infer = Infer(client, settings, metrics)
    try:
        await infer.start()
        first = await tokens_of(infer, prompts[0])
        rest = await asyncio.gather(*(tokens_of(infer, p) for p in prompts[1:]))
        assert infer.in_flight == 0
        # Every block came back: free ones and cached ones nobody holds.
        assert infer.kv_blocks_free == infer.kv_blocks_total
        return [first, *rest], metrics
    finally:
        await infer.stop()
        await client.close()


@pytest.mark.parametrize("shards", [1], indirect=True)
@pytest.mark.parametrize(("caching", "chunk", "budget"), ONE_RANK)
def test_tokens_equal_transformers(
    request: pytest.FixtureRequest, shards: ShardProcesses, prompts: list[list[int]],
    expected: list[list[int]], caching: bool, chunk: int, budget: int,
) -> None:
    if request.node.callspec.params["model"] == "phi-fallback" and chunk in (1, 16):
        pytest.skip("chunks of 7 and 64 cover the fallback")
    check(shards, prompts, expected, caching, chunk, budget)


@pytest.mark.parametrize("shards", [2], indirect=True)
@pytest.mark.parametrize(("caching", "chunk", "budget"), TWO_RANKS)
def test_tokens_equal_transformers_on_two_ranks(
    shards: ShardProcesses, prompts: list[list[int]], expected: list[list[int]],
    caching: bool, chunk: int, budget: int,
) -> None:
    check(shards, prompts, expected, caching, chunk, budget)


def check(
    shards: ShardProcesses, prompts: list[list[int]], expected: list[list[int]],
    caching: bool, chunk: int, budget: int,
) -> None:
    """Greedy tokens equal transformers', blocks come back, and the metrics say the cache was
    (or was not) used and requests were preempted where the budget forces it."""
    got, metrics = asyncio.run(serve(shards, prompts, caching, chunk, budget))
    assert got == expected
    sample = metrics.registry.get_sample_value
    cached = sample("pytgi_request_cached_tokens_sum") or 0.0
    # The shared preamble spans two blocks: with caching on, later prompts reuse them.
    assert (cached > 0) == caching
    preempted = sample("pytgi_preemptions_total") or 0.0
    if budget == ROOMY:
        assert preempted == 0
    elif chunk > 1:
        # In one-token chunks with a shared cached preamble the requests take turns without
        # running out of blocks; with larger chunks they must preempt each other.
        assert preempted > 0

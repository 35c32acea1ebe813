"""An encoder-decoder (the tiny T5) served on 2 ranks by real `pytgi-shard serve` processes and
driven by the router's core (Infer), as the router serves it: no chunks, no prefix caching (the
shards say so in Info), requests joining a running batch (a Prefill encoding them while it
decodes the others), leaving it as they finish (FilterBatch), and taking turns in a KV pool too
small for all of them (preempted, then resumed with their generated tokens, which may take a
resumed sequence past the prefill budget). Every request's greedy tokens and their logprobs equal
transformers' `generate` on the same weights.

tests/integration/test_model_families_serving.py (1 rank) and
tests/e2e/test_model_families_launcher.py (2 ranks) serve t5 and mt5 as every registered
architecture; tests/unit/shard/models/test_t5.py drives the engine step by step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from pytgi_proto.parameters import neutral_sampling
from pytgi_router.core.infer import Infer, InferSettings
from pytgi_router.core.request import StoppingParameters, ValidRequest
from pytgi_router.core.request_stream import Token
from tests.hf_reference import hf_greedy
from tests.integration.test_router_infer import serving
from tests.shard_process import ShardProcesses, start_shards
from tests.tiny_models import build_model

# (text, max_new_tokens): 39, 10, 35, 15 and 18 prompt tokens.
JOINING = [
    ("Paged attention stores keys and values in fixed-size blocks of the cache.", 14),
    ("To be, or not to be", 5),
    ("Continuous batching adds new requests between decode steps: def main():", 18),
    ("Hello world! How are you today?", 9),
    ("Unicode: café, naïve, and accents.", 12),
]
# 10 and 35 prompt tokens, admitted together (45, the prefill budget); the second is the newer.
TURNS = [
    ("To be, or not to be", 30),
    ("Continuous batching adds new requests between decode steps: def main():", 25),
]
# A failed scheduler hangs rather than fails: bound each test's serving.
DEADLINE_S = 60


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Sharp attention, as the other serving tests: the relative position bias decides tokens.
    return build_model(tmp_path_factory.mktemp("t5") / "t5", "t5", std=0.3)


@pytest.fixture(scope="module")
def shards(model: Path) -> Iterator[ShardProcesses]:
    with start_shards(model, world_size=2) as processes:
        yield processes


Case = tuple[list[int], int, tuple[list[int], list[float]]]


def cases_of(model: Path, texts: list[tuple[str, int]]) -> list[Case]:
    """(prompt, max_new_tokens, transformers' greedy tokens and logprobs) per text."""
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    prompts = [(tokenizer.encode(text).ids, n) for text, n in texts]
    return [(p, n, hf_greedy(model, p, n, ignore_eos=True)) for p, n in prompts]


def valid(prompt: list[int], max_new: int) -> ValidRequest:
    return ValidRequest(
        inputs="", input_ids=prompt, truncate=len(prompt), sampling=neutral_sampling(),
        stopping=StoppingParameters(max_new_tokens=max_new, ignore_eos_token=True),
    )


async def tokens_of(
    infer: Infer, prompt: list[int], max_new: int, first: asyncio.Event | None = None
) -> tuple[list[int], list[float]]:
    """The served tokens and their logprobs; `first` is set once the first token arrived."""
    tokens: list[int] = []
    logprobs: list[float] = []
    async for event in infer.submit(valid(prompt, max_new)):
        if isinstance(event, Token):
            tokens.append(event.token.id)
            logprobs.append(event.token.logprob)
            if first is not None:
                first.set()
    return tokens, logprobs


def assert_served(
    got: list[tuple[list[int], list[float]]],
    cases: list[Case],
) -> None:
    for i, ((tokens, logprobs), (_, max_new, (want, want_logprobs))) in enumerate(
        zip(got, cases, strict=True)
    ):
        assert len(want) == max_new, "transformers generated fewer tokens than asked for"
        assert tokens == want, i
        assert logprobs == pytest.approx(want_logprobs, abs=1e-3), i


def test_requests_join_and_leave_a_running_batch(shards: ShardProcesses, model: Path) -> None:
    """The first request runs alone; the others arrive once it streams, join its batch and
    finish at different steps."""
    cases = cases_of(model, JOINING)

    async def main() -> list[tuple[list[int], list[float]]]:
        settings = InferSettings(max_input_tokens=60, max_total_tokens=96,
                                 max_batch_prefill_tokens=128, waiting_served_ratio=0.0)
        async with serving(shards, settings) as infer:
            assert not infer.info.support_chunking and not infer.info.use_prefix_caching
            started = asyncio.Event()
            first = asyncio.create_task(tokens_of(infer, *cases[0][:2], started))
            await started.wait()
            rest = [tokens_of(infer, p, n) for p, n, _ in cases[1:]]
            return [await first, *await asyncio.gather(*rest)]

    assert_served(asyncio.run(asyncio.wait_for(main(), DEADLINE_S)), cases)


def test_requests_take_turns_in_a_small_kv_pool(shards: ShardProcesses, model: Path) -> None:
    """Two requests growing to 7 blocks of 16 in a pool of 5: the newer one, preempted when its
    13th token needs a fourth block, resumes once the other finished, its cross-attention K/V
    computed again from its prompt, with 48 tokens: more than the prefill budget (45) holds."""
    cases = cases_of(model, TURNS)

    async def main() -> tuple[list[tuple[list[int], list[float]]], float]:
        settings = InferSettings(max_input_tokens=44, max_total_tokens=64,
                                 max_batch_prefill_tokens=45, max_batch_total_tokens=80)
        async with serving(shards, settings) as infer:
            got = await asyncio.gather(*(tokens_of(infer, p, n) for p, n, _ in cases))
            preempted = infer.metrics.registry.get_sample_value("pytgi_preemptions_total")
            return list(got), preempted or 0.0

    got, preempted = asyncio.run(asyncio.wait_for(main(), DEADLINE_S))
    assert preempted > 0
    assert_served(got, cases)

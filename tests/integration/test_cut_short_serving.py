"""A newcomer cuts a multi-step Decode call short (router/core/call_cutter.py, the CutShort
RPC, shard/engine/cut_short.py) against real `pytgi-shard serve` processes on the tiny llama,
on one rank and on two (gloo): a request arriving as a call of 64 steps starts is prefilled
after a step or two of it, not after 64, and every stream gets what one step per call gives."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from pytgi_router.core.infer import Infer
from pytgi_router.core.request_stream import RequestStream, Token
from tests.integration.test_multi_step_serving import Stream, read, request, settings
from tests.integration.test_router_infer import PROMPTS, serving, wait_until
from tests.shard_process import ShardProcesses, start_shards

K = 64
LONG = 3 * K + 20


@pytest.fixture(scope="module")
def tokenizer(model: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model / "tokenizer.json"))


@dataclass
class Arrival:
    long: Stream
    newcomer: Stream
    # Tokens the long stream received after the newcomer's submit, before its first token.
    long_tokens_meanwhile: int
    ttft_s: float
    # Time the long stream's first call (K steps) took: its token 1 to token K + 1.
    first_call_s: float
    cut_short: float


async def _arrive_mid_call(infer: Infer, tokenizer: Tokenizer) -> Arrival:
    long_stream = infer.submit(request(tokenizer, PROMPTS[0], LONG))
    received: list[float] = []
    ids: list[int] = []
    logprobs: list[float] = []

    async def take(stream: RequestStream, limit: int | None) -> None:
        async for event in stream:
            if isinstance(event, Token):
                ids.append(event.token.id)
                logprobs.append(round(event.token.logprob, 4))
                received.append(time.monotonic())
            if limit is not None and len(ids) >= limit:
                return

    # The prefill's token and the first call's K: the second call has just been sent.
    await take(long_stream, K + 1)
    submitted = time.monotonic()
    newcomer_stream = infer.submit(request(tokenizer, PROMPTS[5], 12, seed=4))
    rest = asyncio.ensure_future(take(long_stream, None))
    head = await read(newcomer_stream, limit=1)
    ttft = time.monotonic() - submitted
    meanwhile = len(ids) - (K + 1)
    newcomer = await read(newcomer_stream, head=head)
    await rest
    await wait_until(lambda: infer.in_flight == 0)
    assert infer.kv_blocks_free == infer.kv_blocks_total
    cut = infer.metrics.registry.get_sample_value("pytgi_decode_calls_cut_short_total") or 0.0
    return Arrival((ids, logprobs, ""), newcomer, meanwhile, ttft,
                   received[K] - received[0], cut)


def _check(processes: ShardProcesses, tokenizer: Tokenizer) -> None:
    async def run(steps: int) -> Arrival:
        async with serving(processes, settings(steps)) as infer:
            return await _arrive_mid_call(infer, tokenizer)

    cut = asyncio.run(run(K))
    plain = asyncio.run(run(1))
    # Every stream gets what one step per call gives.
    assert cut.long[:2] == plain.long[:2] and len(cut.long[0]) == LONG
    assert cut.newcomer == plain.newcomer
    # The call in flight stopped after the step it was on: the long stream got a few steps
    # (the cut call's, then its row in the newcomer's Prefill; 2-3 measured, a few more if a
    # loaded machine delays the CutShort) before the newcomer's first token, not the call's K.
    assert cut.cut_short >= 1
    assert cut.long_tokens_meanwhile <= 8, cut
    # In time: a small share of a whole K-step call.
    assert cut.ttft_s < cut.first_call_s / 4, cut


@pytest.fixture(scope="module")
def shards(model: Path) -> Iterator[ShardProcesses]:
    with start_shards(model) as processes:
        yield processes


def test_a_newcomer_waits_a_step_not_a_call(shards: ShardProcesses, tokenizer: Tokenizer) -> None:
    _check(shards, tokenizer)


def test_two_ranks_cut_the_call_at_the_same_step(model: Path, tokenizer: Tokenizer) -> None:
    with start_shards(model, world_size=2) as processes:
        _check(processes, tokenizer)

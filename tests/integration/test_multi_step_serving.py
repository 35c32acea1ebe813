"""Multi-step decode (--max-decode-steps; router/core/decode_steps.py, shard/engine/multi_step.py)
against real `pytgi-shard serve` processes on the tiny llama: what every stream gets is what one
step per call gives (greedy and seeded sampling, tokens and logprobs), while a request joins the
running batch (k drops to 1 while it waits) and while a client cancels; on two tensor-parallel
ranks (gloo) too."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from pytgi_proto.parameters import neutral_sampling
from pytgi_router.core.infer import Infer, InferSettings
from pytgi_router.core.request import StoppingParameters, ValidRequest
from pytgi_router.core.request_stream import End, RequestStream, Token
from tests.integration.test_router_infer import PROMPTS, serving, wait_until
from tests.shard_process import ShardProcesses, start_shards

# (tokens, logprobs) of a stream, and its finish reason.
Stream = tuple[list[int], list[float], str]


@pytest.fixture(scope="module")
def shards(model: Path) -> Iterator[ShardProcesses]:
    with start_shards(model) as processes:
        yield processes


@pytest.fixture(scope="module")
def tokenizer(model: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model / "tokenizer.json"))


def settings(steps: int) -> InferSettings:
    """`steps` steps a call, not bounded by time (these tests count steps, which
    --max-decode-call-ms would make depend on the machine's speed)."""
    return InferSettings(max_batch_prefill_tokens=512, max_batch_total_tokens=4096,
                         max_decode_steps=steps, max_decode_call_ms=0)


def request(tokenizer: Tokenizer, text: str, max_new: int, seed: int | None = None,
            ignore_eos: bool = True) -> ValidRequest:
    ids = tokenizer.encode(text).ids
    sampling = (neutral_sampling() if seed is None else
                neutral_sampling(do_sample=True, temperature=0.9, top_k=40, seed=seed))
    return ValidRequest(
        inputs=text, input_ids=ids, truncate=len(ids), sampling=sampling,
        stopping=StoppingParameters(max_new_tokens=max_new, ignore_eos_token=ignore_eos),
    )


async def read(stream: RequestStream, limit: int | None = None,
               head: Stream | None = None) -> Stream:
    """The stream's tokens (after `head`, those read before) up to `limit` or its End."""
    ids: list[int] = list(head[0]) if head else []
    logprobs: list[float] = list(head[1]) if head else []
    reason = ""
    async for event in stream:
        if isinstance(event, Token):
            ids.append(event.token.id)
            logprobs.append(round(event.token.logprob, 4))
            if isinstance(event, End):
                reason = event.finish_reason
                assert event.generated_tokens == len(ids)
        if limit is not None and len(ids) >= limit:
            break
    return ids, logprobs, reason


def workload(tokenizer: Tokenizer) -> list[ValidRequest]:
    """Greedy and seeded-sampling rows of different lengths (rows finish mid-call), one that
    may stop on EOS."""
    out = [request(tokenizer, p, 5 + 7 * i, seed=(100 + i) if i % 2 else None)
           for i, p in enumerate(PROMPTS[:6])]
    out.append(request(tokenizer, PROMPTS[6], 40, ignore_eos=False))
    return out


async def together(infer: Infer, requests: list[ValidRequest]) -> list[Stream]:
    return list(await asyncio.gather(*(read(infer.submit(r)) for r in requests)))


def steps_and_calls(infer: Infer) -> tuple[float, float]:
    sample = infer.metrics.registry.get_sample_value
    steps = sample("pytgi_decode_steps_total") or 0.0
    calls = sample("tgi_batch_inference_count", {"method": "decode"}) or 0.0
    return steps, calls


def test_k_steps_per_call_serve_what_one_step_per_call_serves(
    shards: ShardProcesses, tokenizer: Tokenizer
) -> None:
    requests = workload(tokenizer)

    async def run(steps: int) -> tuple[list[Stream], tuple[float, float]]:
        async with serving(shards, settings(steps)) as infer:
            out = await together(infer, requests)
            assert infer.in_flight == 0 and infer.kv_blocks_free == infer.kv_blocks_total
            return out, steps_and_calls(infer)

    one, (steps1, calls1) = asyncio.run(run(1))
    many, (steps8, calls8) = asyncio.run(run(8))
    assert many == one
    assert steps1 == calls1
    # Most decode steps ran 8 to a call.
    assert steps8 >= 3 * calls8 and steps8 >= 30


def test_a_request_joining_and_a_cancel_leave_the_others_unchanged(
    shards: ShardProcesses, tokenizer: Tokenizer
) -> None:
    long_req = request(tokenizer, PROMPTS[0], 60)
    other = request(tokenizer, PROMPTS[1], 60, seed=5)
    short_req = request(tokenizer, PROMPTS[2], 6, seed=9)

    async def run(steps: int) -> tuple[Stream, Stream, Stream]:
        async with serving(shards, settings(steps)) as infer:
            long_stream = infer.submit(long_req)
            other_stream = infer.submit(other)
            leaving = infer.submit(request(tokenizer, PROMPTS[3], 60))
            head = await read(long_stream, limit=10)
            await read(leaving, limit=3)
            leaving.cancel()
            # A newcomer joins while the batch decodes: the calls in flight end, it prefills.
            short = await read(infer.submit(short_req))
            long_all = await read(long_stream, head=head)
            others = await read(other_stream)
            await wait_until(lambda: infer.in_flight == 0)
            assert infer.kv_blocks_free == infer.kv_blocks_total
            assert [e async for e in leaving] == []
            return long_all, others, short

    assert asyncio.run(run(8)) == asyncio.run(run(1))


def test_two_tensor_parallel_ranks_decode_k_steps_per_call(
    model: Path, tokenizer: Tokenizer
) -> None:
    requests = workload(tokenizer)[:4]

    async def run(processes: ShardProcesses, steps: int) -> list[Stream]:
        async with serving(processes, settings(steps)) as infer:
            out = await together(infer, requests)
            got_steps, calls = steps_and_calls(infer)
            assert steps == 1 or got_steps > calls
            return out

    with start_shards(model, world_size=2) as processes:
        assert asyncio.run(run(processes, 8)) == asyncio.run(run(processes, 1))

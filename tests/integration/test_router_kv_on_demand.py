"""The scheduler's KV on demand, preemption, chunked prefill and prefix caching, through Infer and
a real `pytgi-shard serve` process on the tiny llama (blocks of 16 tokens): a preempted request's
stream equals its uninterrupted run, prompt logprobs over chunks arrive as one Prefill event, a
request cancelled mid-prefill gives its blocks back, stop sequences survive a preemption, and
every block comes back when the load ends."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from pytgi_proto.parameters import neutral_sampling
from pytgi_router.core.infer import Infer, InferSettings
from pytgi_router.core.request import StoppingParameters, ValidRequest
from pytgi_router.core.request_stream import End, Event, Prefill, Token
from tests.integration.test_router_infer import PROMPTS, serving, wait_until
from tests.shard_process import ShardProcesses, start_shards


@pytest.fixture(scope="module")
def shards(model: Path) -> Iterator[ShardProcesses]:
    with start_shards(model) as processes:
        yield processes


@pytest.fixture(scope="module")
def tokenizer(model: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model / "tokenizer.json"))


def config(prefill: int = 512, budget: int = 4096, caching: bool = True) -> InferSettings:
    max_total = min(budget, 200)
    return InferSettings(max_batch_prefill_tokens=prefill, max_batch_total_tokens=budget,
                         max_total_tokens=max_total, max_input_tokens=max_total - 1,
                         prefix_caching=caching)


def request(ids: list[int], new: int, stop: list[str] | None = None,
            logprobs: bool = False) -> ValidRequest:
    return ValidRequest(
        inputs="", input_ids=ids, truncate=len(ids), sampling=neutral_sampling(),
        stopping=StoppingParameters(max_new_tokens=new, stop_sequences=stop or [],
                                    ignore_eos_token=True),
        prefill_logprobs=logprobs,
    )


async def events_of(infer: Infer, req: ValidRequest) -> list[Event]:
    return [event async for event in infer.submit(req)]


def summary(events: list[Event]) -> tuple[list[int], str, str]:
    """(token ids, final text, finish reason); checks the stream's shape on the way."""
    prefills = [e for e in events if isinstance(e, Prefill)]
    assert len(prefills) <= 1 and all(isinstance(e, Prefill) for e in events[:len(prefills)])
    tokens = [e for e in events if isinstance(e, Token)]
    end = events[-1]
    assert isinstance(end, End) and end.generated_tokens == len(tokens)
    return [t.token.id for t in tokens], end.generated_text, end.finish_reason


async def drained(infer: Infer) -> None:
    """Every request ended and every block is back (free, or cached and unreferenced)."""
    await wait_until(lambda: infer.in_flight == 0)
    assert infer.kv_blocks_free == infer.kv_blocks_total


def metric(infer: Infer, name: str) -> float:
    return infer.metrics.registry.get_sample_value(name) or 0.0


def test_preempted_requests_stream_what_they_stream_uninterrupted(
    shards: ShardProcesses, tokenizer: Tokenizer
) -> None:
    """Six requests growing to ~5 blocks each in a pool of 8 blocks must take turns; each
    stream (tokens, text, one End) equals the request's run alone on a roomy server."""
    requests = [request(tokenizer.encode(p).ids, 60) for p in PROMPTS[:6]]

    async def main() -> None:
        async with serving(shards, config()) as infer:
            alone = [summary(await events_of(infer, r)) for r in requests]
        async with serving(shards, config(budget=128)) as infer:
            together = await asyncio.gather(*(events_of(infer, r) for r in requests))
            assert [summary(e) for e in together] == alone
            assert metric(infer, "pytgi_preemptions_total") > 0
            await drained(infer)
            assert metric(infer, "tgi_batch_current_max_tokens") == 0

    asyncio.run(main())


def late_stop(text: str) -> str:
    """The printable ASCII trigram of `text` first seen the latest: a stop sequence that ends
    the generation late (after the preemptions of a tight pool), wherever it is matched."""
    for i in range(len(text) - 3, -1, -1):
        trigram = text[i:i + 3]
        if trigram.isascii() and trigram.isprintable() and text.find(trigram) == i:
            return trigram
    raise AssertionError(f"no ASCII trigram in {text!r}")


def test_stop_sequences_hold_across_a_preemption(
    shards: ShardProcesses, tokenizer: Tokenizer
) -> None:
    ids = [tokenizer.encode(p).ids for p in PROMPTS[6:10]]

    async def main() -> None:
        async with serving(shards, config()) as infer:
            texts = [summary(await events_of(infer, request(i, 60)))[1] for i in ids]
            stops = [[late_stop(text)] for text in texts]
            alone = [summary(await events_of(infer, request(i, 60, s)))
                     for i, s in zip(ids, stops, strict=True)]
            assert all(reason == "stop_sequence" for _, _, reason in alone)
        async with serving(shards, config(budget=128)) as infer:
            together = await asyncio.gather(
                *(events_of(infer, request(i, 60, s)) for i, s in zip(ids, stops, strict=True)))
            assert [summary(e) for e in together] == alone
            assert metric(infer, "pytgi_preemptions_total") > 0
            await drained(infer)

    asyncio.run(main())


def test_prompt_logprobs_over_chunks_arrive_once_and_equal_one_prefill(
    shards: ShardProcesses, tokenizer: Tokenizer
) -> None:
    """A prefill budget of 7 tokens splits a ~40-token prompt into 6 chunks (mixed with another
    request's decode steps); its one Prefill event equals the unchunked one, and a request
    asking for prompt logprobs never starts from the prefix cache."""
    ids = tokenizer.encode(" ".join(PROMPTS[:6])).ids
    assert len(ids) > 30

    def prompt_logprobs(events: list[Event]) -> tuple[list[int], list[float]]:
        prefill = events[0]
        assert isinstance(prefill, Prefill)
        return [t.id for t in prefill.tokens], [t.logprob for t in prefill.tokens[1:]]

    async def main() -> None:
        async with serving(shards, config()) as infer:
            whole = await events_of(infer, request(ids, 5, logprobs=True))
        async with serving(shards, config(prefill=7)) as infer:
            other = asyncio.ensure_future(events_of(infer, request(ids[:5], 30)))
            chunked = await events_of(infer, request(ids, 5, logprobs=True))
            # The same prompt again: its blocks are cached now, but it must compute them all.
            again = await events_of(infer, request(ids, 5, logprobs=True))
            await other
            assert summary(chunked) == summary(whole) == summary(again)
            whole_ids, whole_logprobs = prompt_logprobs(whole)
            assert whole_ids == ids
            for events in (chunked, again):
                got_ids, got_logprobs = prompt_logprobs(events)
                assert got_ids == ids and got_logprobs == pytest.approx(whole_logprobs, abs=1e-4)
            # Each prompt once: nothing came from the cache for these three.
            assert metric(infer, "pytgi_request_cached_tokens_sum") == 0
            await drained(infer)

    asyncio.run(main())


def test_a_cached_prefix_is_reused_and_counted(
    shards: ShardProcesses, tokenizer: Tokenizer
) -> None:
    preamble = tokenizer.encode(" ".join(PROMPTS)).ids[:48]  # three whole blocks

    async def main() -> None:
        for caching in (True, False):
            async with serving(shards, config(caching=caching)) as infer:
                first = summary(await events_of(infer, request(preamble + [40, 41], 8)))
                second = summary(await events_of(infer, request(preamble + [40, 41], 8)))
                assert first == second
                cached = metric(infer, "pytgi_request_cached_tokens_sum")
                ratio = metric(infer, "pytgi_prefix_cache_hit_ratio")
                if caching:
                    assert cached == 48 and ratio == pytest.approx(48 / 100)
                else:
                    assert cached == 0 and ratio == 0
                await drained(infer)

    asyncio.run(main())


def test_a_request_cancelled_mid_prefill_gives_back_its_blocks(
    shards: ShardProcesses, tokenizer: Tokenizer
) -> None:
    """With a prefill budget of 1 token per step a long prompt stays mid-prefill for many steps;
    cancelled there it leaves at once, and the request running beside it goes on."""
    ids = tokenizer.encode(" ".join(PROMPTS)).ids[:120]

    async def main() -> None:
        async with serving(shards, config()) as infer:
            expected = summary(await events_of(infer, request(ids[:4], 80)))
        async with serving(shards, config(prefill=1)) as infer:
            total = infer.kv_blocks_total
            beside = asyncio.ensure_future(events_of(infer, request(ids[:4], 80)))
            await wait_until(lambda: infer.kv_blocks_free < total)
            long = infer.submit(request(ids, 5))
            # Admitted: its 8 blocks (121 tokens) beside the other's 6 at most (84 tokens).
            await wait_until(lambda: total - infer.kv_blocks_free >= 9)
            assert infer.queue_size == 0 and not long.closed
            long.cancel()
            assert [e async for e in long] == []
            await wait_until(lambda: total - infer.kv_blocks_free <= 6)
            assert not beside.done(), "the running request is still generating"
            assert summary(await beside) == expected
            await drained(infer)

    asyncio.run(main())


def test_best_of_copies_share_their_prompt_blocks_and_sample_as_alone(
    shards: ShardProcesses, tokenizer: Tokenizer
) -> None:
    """best_of submits copies of one prompt with their own seeds, together: they are admitted
    in the same step (their identical blocks cached once), later ones hit the cache, and each
    samples what it samples alone."""
    ids = tokenizer.encode(" ".join(PROMPTS[:4])).ids[:40]

    def sampled(seed: int) -> ValidRequest:
        req = request(ids, 12)
        req.sampling = neutral_sampling(do_sample=True, temperature=0.9, seed=seed)
        return req

    async def main() -> None:
        async with serving(shards, config(caching=False)) as infer:
            alone = [summary(await events_of(infer, sampled(seed))) for seed in (1, 2, 3)]
        async with serving(shards, config()) as infer:
            copies = await asyncio.gather(*(events_of(infer, sampled(s)) for s in (1, 2, 3)))
            assert [summary(e) for e in copies] == alone
            assert metric(infer, "pytgi_request_cached_tokens_sum") == 0, "none committed yet"
            assert summary(await events_of(infer, sampled(3))) == alone[2]
            assert metric(infer, "pytgi_request_cached_tokens_sum") == 32
            await drained(infer)

    asyncio.run(main())

"""Infer (queue, scheduler, block allocator, gRPC client) against real `pytgi-shard serve` processes
on the tiny llama: continuous batching, joining a running batch, batch-invariant greedy output,
cancellation, overload and a shard that dies mid-generation."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from pytgi_proto.parameters import neutral_sampling
from pytgi_router.core.errors import GenerationError, OverloadedError, UnhealthyError
from pytgi_router.core.infer import Infer, InferSettings
from pytgi_router.core.request import StoppingParameters, ValidRequest
from pytgi_router.core.request_stream import End, RequestStream, Token
from pytgi_router.core.shard_client import ShardClient
from pytgi_router.metrics import Metrics
from tests.shard_process import ShardProcesses, start_shards

PROMPTS = [
    "The quick brown fox", "To be, or not to be", "Hello world!", "Paged attention stores keys",
    "Continuous batching adds", "Numbers: 0 1 2 3", "Unicode: café", "def main():",
    "The lazy dog", "that is the question.", "How are you today?", "fixed-size blocks",
    "between decode steps", "symbols: {}[]()", "Привет", "print('hello')",
]


@pytest.fixture(scope="module")
def shards(model: Path) -> Iterator[ShardProcesses]:
    with start_shards(model) as processes:
        yield processes


@pytest.fixture(scope="module")
def tokenizer(model: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model / "tokenizer.json"))


def settings(**overrides: int | None) -> InferSettings:
    base = InferSettings(max_batch_prefill_tokens=512, max_batch_total_tokens=4096)
    for key, value in overrides.items():
        setattr(base, key, value)
    return base


@asynccontextmanager
async def serving(shards: ShardProcesses, config: InferSettings) -> AsyncIterator[Infer]:
    client = await ShardClient.connect(shards.urls[0])
    infer = Infer(client, config, Metrics())
    try:
        await infer.start()
        yield infer
    finally:
        await infer.stop()
        await client.close()


def request(tokenizer: Tokenizer, text: str, max_new_tokens: int) -> ValidRequest:
    ids = tokenizer.encode(text).ids
    # ignore_eos_token: a random model may pick EOS at any step; lengths must be predictable.
    return ValidRequest(
        inputs=text, input_ids=ids, truncate=len(ids), sampling=neutral_sampling(),
        stopping=StoppingParameters(max_new_tokens=max_new_tokens, ignore_eos_token=True),
    )


@dataclass
class Log:
    """Arrival order of every event, across all requests of a test."""

    order: list[tuple[int, int]] = field(default_factory=list)

    async def read(
        self,
        key: int,
        stream: RequestStream,
        limit: int | None = None,
        ids: list[int] | None = None,
    ) -> list[int]:
        """Token ids read from `stream` (appended to `ids`, to continue an earlier read)."""
        ids = [] if ids is None else ids
        async for event in stream:
            if isinstance(event, Token):
                ids.append(event.token.id)
                self.order.append((key, len(ids)))
                if isinstance(event, End):
                    assert event.generated_tokens == len(ids)
                    assert event.queued_at <= event.started_at <= event.finished_at
            if limit is not None and len(ids) >= limit:
                break
        return ids

    def position(self, key: int, index: int) -> int:
        return self.order.index((key, index))


async def solo(infer: Infer, req: ValidRequest) -> list[int]:
    return await Log().read(0, infer.submit(req))


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_concurrent_requests_interleave_and_match_their_solo_runs(
    shards: ShardProcesses, tokenizer: Tokenizer
) -> None:
    requests = [request(tokenizer, p, 4 + i % 5) for i, p in enumerate(PROMPTS)]

    async def main() -> None:
        async with serving(shards, settings()) as infer:
            alone = [await solo(infer, r) for r in requests]
            log = Log()
            streams = [infer.submit(r) for r in requests]
            together = await asyncio.gather(*(log.read(i, s) for i, s in enumerate(streams)))
            assert together == alone
            assert [len(t) for t in together] == [r.stopping.max_new_tokens for r in requests]
            # One batch: every request's first token comes before any request's last one.
            firsts = [log.position(i, 1) for i in range(len(requests))]
            lasts = [log.position(i, len(t)) for i, t in enumerate(together)]
            assert max(firsts) < min(lasts)
            assert infer.in_flight == 0 and infer.kv_blocks_free == infer.kv_blocks_total
            sample = infer.metrics.registry.get_sample_value
            assert sample("tgi_batch_max_total_tokens") == infer.info.max_batch_total_tokens
            assert sample("pytgi_kv_blocks_total") == infer.kv_blocks_total
            assert sample("pytgi_kv_blocks_free") == infer.kv_blocks_total
            assert sample("tgi_batch_current_size") == 0 and sample("tgi_queue_size") == 0
            # 16 solo runs plus the shared batch.
            assert sample("tgi_batch_inference_success", {"method": "prefill"}) == 17
            decodes = sample("tgi_batch_inference_count", {"method": "decode"})
            assert decodes == sample("tgi_batch_inference_success", {"method": "decode"})
            assert sample("tgi_batch_next_size_count") == 17
            assert sample("tgi_batch_forward_duration_count", {"method": "decode"}) == decodes

    asyncio.run(main())


def test_a_new_request_joins_the_running_batch(
    shards: ShardProcesses, tokenizer: Tokenizer
) -> None:
    long_req = request(tokenizer, "The quick brown fox", 60)
    short_req = request(tokenizer, "Hello world!", 3)

    async def main() -> None:
        async with serving(shards, settings()) as infer:
            short_alone = await solo(infer, short_req)
            log = Log()
            long_stream = infer.submit(long_req)
            long_head = await log.read(0, long_stream, limit=2)
            long_rest = asyncio.ensure_future(log.read(0, long_stream, ids=long_head))
            short = await log.read(1, infer.submit(short_req))
            long_tokens = await long_rest
            assert short == short_alone
            assert len(long_tokens) == 60
            assert log.position(1, 3) < log.position(0, 60), "short waited for the long one"
            concat = infer.metrics.registry.get_sample_value(
                "tgi_batch_concat", {"reason": "backpressure"}
            )
            assert concat is not None and concat >= 1

    asyncio.run(main())


def test_cancelled_requests_leave_within_a_step_and_free_their_blocks(
    shards: ShardProcesses, tokenizer: Tokenizer
) -> None:
    async def main() -> None:
        async with serving(shards, settings()) as infer:
            total = infer.kv_blocks_total
            streams = [infer.submit(request(tokenizer, p, 200)) for p in PROMPTS[:4]]
            for i, stream in enumerate(streams):
                await Log().read(i, stream, limit=2)
            running_blocks = total - infer.kv_blocks_free
            streams[0].cancel()
            streams[1].cancel()
            streams[1].cancel()
            assert infer.in_flight == 2
            # The two others are still generating while the cancelled ones' blocks come back.
            await wait_until(lambda: infer.kv_blocks_free > total - running_blocks)
            assert not streams[2].closed and not streams[3].closed
            assert [e async for e in streams[0]] == []
            streams[2].cancel()
            streams[3].cancel()
            await wait_until(lambda: infer.kv_blocks_free == total)
            assert infer.in_flight == 0

    asyncio.run(main())


def test_a_cancelled_queued_request_leaves_the_queue_at_once(
    shards: ShardProcesses, tokenizer: Tokenizer
) -> None:
    async def main() -> None:
        async with serving(shards, settings(max_batch_size=1)) as infer:
            first = infer.submit(request(tokenizer, "The quick brown fox", 100))
            await Log().read(0, first, limit=1)
            waiting = infer.submit(request(tokenizer, "Hello world!", 5))
            await asyncio.sleep(0.05)
            assert infer.queue_size == 1, "max_batch_size=1 keeps the second one waiting"
            waiting.cancel()
            assert infer.queue_size == 0 and infer.in_flight == 1
            first.cancel()
            await wait_until(lambda: infer.kv_blocks_free == infer.kv_blocks_total)

    asyncio.run(main())


def test_overload_and_shutdown_refuse_requests(
    shards: ShardProcesses, tokenizer: Tokenizer
) -> None:
    async def main() -> None:
        async with serving(shards, settings(max_concurrent_requests=2)) as infer:
            a = infer.submit(request(tokenizer, "The quick brown fox", 100))
            infer.submit(request(tokenizer, "Hello world!", 100))
            with pytest.raises(OverloadedError):
                infer.submit(request(tokenizer, "To be", 3))
            a.cancel()
            assert len(await solo(infer, request(tokenizer, "To be", 3))) == 3
        async with serving(shards, settings(max_queue_size=1)) as infer:
            infer.submit(request(tokenizer, "The quick brown fox", 3))
            # Submitted in the same tick: the first one still fills the queue.
            with pytest.raises(OverloadedError):
                infer.submit(request(tokenizer, "Hello world!", 3))
        async with serving(shards, settings()) as infer:
            reader = asyncio.ensure_future(
                Log().read(0, infer.submit(request(tokenizer, "Hello world!", 20)))
            )
            await infer.stop(drain_timeout=10)
            assert len(await reader) == 20, "stop(drain_timeout) lets in-flight requests finish"
            with pytest.raises(UnhealthyError):
                infer.submit(request(tokenizer, "To be", 3))

    asyncio.run(main())


def test_a_dead_shard_fails_in_flight_requests_and_health(
    model: Path, tokenizer: Tokenizer
) -> None:
    async def main(processes: ShardProcesses) -> None:
        async with serving(processes, settings()) as infer:
            assert await infer.health()
            streams = [infer.submit(request(tokenizer, p, 200)) for p in PROMPTS[:3]]
            for i, stream in enumerate(streams):
                await Log().read(i, stream, limit=1)
            processes.procs[0].send_signal(signal.SIGKILL)
            for i, stream in enumerate(streams):
                with pytest.raises(GenerationError, match="Request failed during generation"):
                    await asyncio.wait_for(Log().read(i, stream), timeout=10)
            assert infer.in_flight == 0 and infer.kv_blocks_free == infer.kv_blocks_total
            assert not await infer.health()
            failures = infer.metrics.registry.get_sample_value(
                "tgi_batch_inference_failure", {"method": "decode"}
            )
            assert failures == 1
            # The loop keeps serving: a new request fails fast instead of hanging.
            with pytest.raises(GenerationError):
                await asyncio.wait_for(solo(infer, request(tokenizer, "To be", 3)), timeout=10)

    with start_shards(model) as processes:
        asyncio.run(main(processes))


def test_two_ranks_generate_like_one_and_a_dead_rank_fails_fast(
    model: Path, tokenizer: Tokenizer, shards: ShardProcesses
) -> None:
    requests = [request(tokenizer, p, 6) for p in PROMPTS[:4]]

    async def one_rank() -> list[list[int]]:
        async with serving(shards, settings()) as infer:
            return [await solo(infer, r) for r in requests]

    async def two_ranks(processes: ShardProcesses, expected: list[list[int]]) -> None:
        async with serving(processes, settings()) as infer:
            assert infer.info.world_size == 2
            log = Log()
            streams = [infer.submit(r) for r in requests]
            got = await asyncio.gather(*(log.read(i, s) for i, s in enumerate(streams)))
            assert got == expected
            stream = infer.submit(request(tokenizer, "The quick brown fox", 200))
            await Log().read(0, stream, limit=1)
            # Rank 0 is left blocked in a collective: the client must not wait for it.
            processes.procs[1].send_signal(signal.SIGKILL)
            with pytest.raises(GenerationError):
                await asyncio.wait_for(Log().read(0, stream), timeout=10)
            assert infer.kv_blocks_free == infer.kv_blocks_total
            # Rank 0 would sit in its collective until gloo's timeout, deaf to SIGTERM.
            processes.procs[0].send_signal(signal.SIGKILL)

    expected = asyncio.run(one_rank())
    with start_shards(model, world_size=2) as processes:
        asyncio.run(two_ranks(processes, expected))


# Tracing needs an SDK tracer provider installed process-wide, which must not leak into the other
# tests: this part runs in its own interpreter and prints the finished spans as JSON.
TRACED_ROUTER = """
import asyncio, json, sys
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pytgi_router.core.shard_client import ShardClient
from pytgi_router.core.infer import Infer, InferSettings
from pytgi_router.metrics import Metrics
from pytgi_proto.parameters import neutral_sampling
from pytgi_router.core.request import StoppingParameters, ValidRequest

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)

async def main():
    client = await ShardClient.connect(sys.argv[1], traced=True)
    # One decode step per call (no multi-step decode): a span per step.
    infer = Infer(client, InferSettings(max_batch_prefill_tokens=64, max_batch_total_tokens=512,
                                        max_decode_steps=1), Metrics())
    await infer.start()
    stopping = StoppingParameters(3, ignore_eos_token=True)
    request = ValidRequest("hi", [1, 40, 41], 3, neutral_sampling(), stopping)
    with trace.get_tracer("test").start_as_current_span("request"):
        stream = infer.submit(request)
    async for _ in stream:
        pass
    await infer.stop()
    await client.close()

asyncio.run(main())
print(json.dumps([
    {"name": s.name, "id": s.context.span_id, "trace": s.context.trace_id,
     "parent": s.parent.span_id if s.parent else None,
     "links": [link.context.span_id for link in s.links]}
    for s in exporter.get_finished_spans()
]))
"""


def test_batch_spans_link_requests_and_parent_the_shard_calls(shards: ShardProcesses) -> None:
    out = subprocess.run(
        [sys.executable, "-c", TRACED_ROUTER, shards.urls[0]],
        capture_output=True, text=True, timeout=60, check=True,
    )
    spans = json.loads(out.stdout.strip().splitlines()[-1])
    by_name: dict[str, list[dict]] = {}
    for span in spans:
        by_name.setdefault(span["name"], []).append(span)
    (request_span,) = by_name["request"]
    (prefill,) = by_name["prefill"]
    assert prefill["links"] == [request_span["id"]]
    decodes = by_name["decode"]
    assert len(decodes) == 2
    # The gRPC client spans (whose context the interceptor injects into the call's metadata)
    # are children of the batch spans.
    rpc = "/pytgi.generate.v1.TextGenerationService/"
    (prefill_call,) = by_name[rpc + "Prefill"]
    assert (prefill_call["parent"], prefill_call["trace"]) == (prefill["id"], prefill["trace"])
    decode_parents = sorted(s["parent"] for s in by_name[rpc + "Decode"])
    assert decode_parents == sorted(s["id"] for s in decodes)

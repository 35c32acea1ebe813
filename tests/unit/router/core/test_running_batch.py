"""The live requests' bookkeeping: wire messages, event routing, prompt logprobs over chunks,
prefix-cache commits, preemption, retiring and filtering."""

from __future__ import annotations

import asyncio
import math
from collections import deque

import pytest

from pytgi_proto import generate_pb2
from pytgi_proto.parameters import neutral_sampling
from pytgi_router.core.batch_wire import build_batch, request_pb
from pytgi_router.core.errors import GenerationError, IncompleteGenerationError
from pytgi_router.core.prefix_cache import PrefixCache
from pytgi_router.core.request import (
    Entry,
    EntryState,
    StoppingParameters,
    ValidRequest,
)
from pytgi_router.core.request_stream import End, Event, Prefill, RequestStream, Token
from pytgi_router.core.running_batch import RunningBatch, route_generation
from pytgi_router.core.step_plan import Chunk


def make_entry(entry_id: int, cache: PrefixCache, prompt: int = 3, new: int = 5) -> Entry:
    request = ValidRequest(
        inputs="hello",
        input_ids=list(range(10, 10 + prompt)),
        truncate=prompt,
        sampling=neutral_sampling(temperature=0.7, top_k=5, do_sample=True, seed=42),
        stopping=StoppingParameters(max_new_tokens=new, stop_sequences=["\n"]),
        top_n_tokens=2,
    )
    entry = Entry(entry_id, request, RequestStream(), request_pb(entry_id, request))
    admission = cache.admit(entry_id, entry.tokens, 1)
    assert admission is not None
    entry.blocks_held = len(admission.blocks)
    entry.order = entry_id
    return entry


def tokens(*ids: int) -> generate_pb2.Tokens:
    return generate_pb2.Tokens(
        ids=ids, logprobs=[-0.25] * len(ids), texts=[f"<{i}>" for i in ids],
        is_special=[False] * len(ids),
    )


def generation(request_id: int, *ids: int, final: str | None = None) -> generate_pb2.Generation:
    g = generate_pb2.Generation(request_id=request_id, tokens=tokens(*ids))
    if final is not None:
        g.generated_text.CopyFrom(generate_pb2.GeneratedText(
            text=final, generated_tokens=len(ids),
            finish_reason=generate_pb2.FINISH_REASON_EOS_TOKEN,
        ))
    return g


def drain(stream: RequestStream) -> list[Event]:
    async def read() -> list[Event]:
        return [event async for event in stream]

    return asyncio.run(read())


def test_build_batch_carries_blocks_chunks_and_parameters() -> None:
    cache = PrefixCache(20, 4)
    a, b = make_entry(7, cache, prompt=3, new=5), make_entry(8, cache, prompt=9, new=8)
    batch = build_batch(3, [Chunk.of(a, 0, 3), Chunk.of(b, 4, 2)], cache)
    assert batch.id == 3 and batch.size == 2
    assert [r.id for r in batch.requests] == [7, 8]
    assert tuple(batch.requests[0].blocks) == cache.table(7) and len(cache.table(7)) == 1
    assert len(batch.requests[1].blocks) == 3  # 9 + 1 tokens: never max_new_tokens
    assert batch.max_blocks == 3 and batch.max_tokens == 4 * 4
    assert [(r.cache_len, r.chunk_len) for r in batch.requests] == [(0, 3), (4, 2)]
    req = batch.requests[0]
    assert list(req.input_ids) == [10, 11, 12]
    assert req.parameters.seed == 42 and req.parameters.do_sample
    assert req.parameters.top_k == 5 and math.isclose(req.parameters.temperature, 0.7, rel_tol=1e-6)
    assert req.stopping_parameters.max_new_tokens == 5
    assert list(req.stopping_parameters.stop_sequences) == ["\n"]
    assert req.top_n_tokens == 2


def test_the_sampling_type_rejects_values_the_wire_cannot_carry() -> None:
    """A request's sampling is the wire's message: a seed past 64 bits cannot even be built."""
    with pytest.raises(ValueError):
        neutral_sampling(seed=2**64)


def test_route_generation_makes_tokens_then_end_with_timestamps() -> None:
    entry = make_entry(1, PrefixCache(20, 4))
    entry.request.prefill_logprobs = True
    entry.started_at = 5.0
    g = generation(1, 4, 5, final="done")
    g.top_tokens.extend([tokens(4, 9), tokens(5, 8)])
    g.generated_text.seed = 42
    g.prefill_tokens.CopyFrom(tokens(10, 11, 12))
    assert route_generation(entry, g, now=9.0)
    events = drain(entry.stream)
    assert isinstance(events[0], Prefill) and [t.id for t in events[0].tokens] == [10, 11, 12]
    first, last = events[1], events[2]
    assert type(first) is Token and first.token.id == 4 and first.token.text == "<4>"
    assert [t.id for t in first.top_tokens] == [4, 9]
    assert isinstance(last, End) and last.token.id == 5
    assert (last.generated_text, last.finish_reason, last.seed) == ("done", "eos_token", 42)
    assert (last.queued_at, last.started_at, last.finished_at) == (entry.queued_at, 5.0, 9.0)
    assert entry.generated == [4, 5]


def test_route_generation_tolerates_missing_optional_lists() -> None:
    entry = make_entry(1, PrefixCache(20, 4))
    g = generate_pb2.Generation(request_id=1, tokens=generate_pb2.Tokens(ids=[3]))
    assert not route_generation(entry, g, now=1.0)
    entry.stream.fail(GenerationError("stop reading"))
    with pytest.raises(GenerationError):
        drain(entry.stream)


def make_running(n: int, prompt: int = 3) -> tuple[RunningBatch, list[Entry], list[int]]:
    """`n` entries whose prompt (of `prompt` tokens) is computed in the step to come."""
    cache = PrefixCache(50, 4)
    released: list[int] = []
    running = RunningBatch(cache, lambda e: released.append(e.id))
    entries = [make_entry(i, cache, prompt) for i in range(n)]
    running.start([Chunk.of(e, 0, prompt) for e in entries])
    return running, entries, released


def cached(*ids: int) -> generate_pb2.CachedBatch:
    return generate_pb2.CachedBatch(id=0, request_ids=ids, size=len(ids))


def test_step_with_no_change_needs_no_filter() -> None:
    running, _, released = make_running(3)
    assert running.reserved_tokens == 3 * 1 * 4
    kept = running.apply_step([generation(0, 1), generation(1, 1), generation(2, 1)],
                              cached(0, 1, 2))
    assert kept is None and released == [] and len(running) == 3


def test_finished_request_is_retired_and_filtered_out() -> None:
    running, entries, released = make_running(3)
    kept = running.apply_step([generation(0, 1), generation(1, 2, final="x"), generation(2, 1)],
                              cached(0, 1, 2))
    assert kept == [0, 2]
    assert released == [1] and 1 not in running.cache
    assert running.cache.used_count == 2
    assert isinstance(drain(entries[1].stream)[-1], End)


def test_cancelled_request_keeps_its_blocks_until_the_step_ends() -> None:
    running, entries, released = make_running(2)
    entries[0].stream.cancel()
    running.mark_cancelled(0)
    assert running.cache.used_count == 2, "blocks stay held while the shard may write them"
    kept = running.apply_step([generation(0, 1), generation(1, 1)], cached(0, 1))
    assert kept == [1] and released == [0]
    assert running.cache.used_count == 1


def test_all_finished_means_drop_the_batch() -> None:
    running, _, _ = make_running(2)
    kept = running.apply_step([generation(0, 1, final="a"), generation(1, 1, final="b")],
                              cached(0, 1))
    assert kept == [] and len(running) == 0 and running.cache.used_count == 0


def test_requests_the_shard_lost_end_incomplete() -> None:
    running, entries, released = make_running(3)
    # The shard returns no batch although request 2 never finished.
    running.apply_step([generation(0, 1, final="a"), generation(1, 1, final="b")], None)
    assert sorted(released) == [0, 1, 2] and running.cache.used_count == 0
    with pytest.raises(IncompleteGenerationError):
        drain(entries[2].stream)
    running2, entries2, _ = make_running(2)
    assert running2.apply_step([generation(0, 1)], cached(0)) == [0]
    with pytest.raises(IncompleteGenerationError):
        drain(entries2[1].stream)


def test_fail_all_fails_every_stream_and_frees_everything() -> None:
    running, entries, released = make_running(3)
    running.fail_all(GenerationError("Server error: gone"))
    assert sorted(released) == [0, 1, 2] and running.cache.used_count == 0
    assert running.cached is None and running.reserved_tokens == 0
    for entry in entries:
        with pytest.raises(GenerationError, match="gone"):
            drain(entry.stream)


def partial(request_id: int, *ids: int) -> generate_pb2.Generation:
    """What a shard answers for a partial chunk of a request that asked for prompt logprobs."""
    return generate_pb2.Generation(request_id=request_id, prefill_tokens=tokens(*ids))


def test_prompt_logprobs_over_chunks_make_one_prefill_event_in_order() -> None:
    cache = PrefixCache(50, 4)
    running = RunningBatch(cache, lambda e: None)
    entry = make_entry(0, cache, prompt=9)
    entry.request.prefill_logprobs = True
    for cache_len, length, ids in ((0, 4, (10, 11, 12, 13)), (4, 4, (14, 15, 16, 17))):
        chunk = Chunk.of(entry, cache_len, length)
        running.start([chunk])
        assert entry.state is EntryState.PREFILLING and not running.entries
        assert running.apply_step([partial(0, *ids)], None) is None
        running.chunks_written([chunk])
        assert entry.computed == cache_len + length
    assert entry.stream._events == deque(), "nothing streams before the prompt is done"
    last = Chunk.of(entry, 8, 1)
    running.start([last])
    g = generation(0, 5)
    g.prefill_tokens.CopyFrom(tokens(18))
    assert running.apply_step([g], cached(0)) is None
    events = list(entry.stream._events)
    prefill, token = events
    assert isinstance(prefill, Prefill) and [t.id for t in prefill.tokens] == list(range(10, 19))
    assert isinstance(token, Token) and token.token.id == 5
    assert entry.state is EntryState.RUNNING and entry.computed == 9


def test_full_blocks_are_committed_once_their_kv_is_written() -> None:
    running, entries, _ = make_running(1, prompt=3)
    cache = running.cache
    entry = entries[0]
    running.apply_step([generation(0, 7)], cached(0))  # KV of 3 tokens: no full block
    assert cache.cached_count == 0 and entry.computed == 3
    running.apply_step([generation(0, 8)], cached(0))  # 4 tokens written: one block
    assert cache.cached_count == 1 and entry.computed == 4
    assert cache.cached_prefix([1, 2, 3, 7, 8, 9]) == 0, "other tokens: no hit"
    assert cache.cached_prefix([10, 11, 12, 7, 99]) == 4
    running.apply_step([generation(0, 9, final="x")], cached())
    assert cache.used_count == 0 and cache.free_count == cache.total, "all back, one cached"


def test_a_partial_chunk_commits_the_blocks_it_completed() -> None:
    cache = PrefixCache(50, 4)
    running = RunningBatch(cache, lambda e: None)
    entry = make_entry(0, cache, prompt=10)
    chunk = Chunk.of(entry, 0, 6)
    running.start([chunk])
    running.apply_step([], None)
    running.chunks_written([chunk])
    assert cache.cached_count == 1 and entry.computed == 6


def test_preemption_keeps_the_stream_open_and_resumes_after_the_generated_tokens() -> None:
    running, entries, released = make_running(2)
    running.apply_step([generation(0, 7), generation(1, 8)], cached(0, 1))
    entry = entries[1]
    entry.pb.prefill_logprobs = True
    running.cache.release(1)  # the planner's part
    assert running.preempt(entry)
    assert 1 not in running.entries and released == [] and not entry.stream.closed
    assert list(entry.pb.generated_ids) == [8] and not entry.pb.prefill_logprobs
    assert (entry.state, entry.computed, entry.blocks_held) == (EntryState.WAITING, 0, 0)
    assert entry.tokens == [10, 11, 12, 8]
    # A cancelled victim leaves for good instead.
    other = entries[0]
    other.stream.cancel()
    running.mark_cancelled(0)
    running.cache.release(0)
    assert not running.preempt(other) and released == [0] and len(running) == 0


def test_a_cancelled_prefill_leaves_between_steps_with_its_blocks() -> None:
    cache = PrefixCache(50, 4)
    released: list[int] = []
    running = RunningBatch(cache, lambda e: released.append(e.id))
    entry = make_entry(0, cache, prompt=10)
    chunk = Chunk.of(entry, 0, 4)
    running.start([chunk])
    running.apply_step([], None)
    running.chunks_written([chunk])
    entry.stream.cancel()
    running.drop_cancelled_prefills()
    assert released == [0] and len(running) == 0
    assert cache.used_count == 0 and cache.free_count == cache.total

"""The running batch's bookkeeping: wire messages, event routing, retiring and filtering."""

from __future__ import annotations

import asyncio
import math

import pytest

from pytgi_proto import generate_pb2
from pytgi_router.core.batch_state import RunningBatch, build_batch, request_pb, route_generation
from pytgi_router.core.block_allocator import BlockAllocator
from pytgi_router.core.errors import GenerationError, IncompleteGenerationError
from pytgi_router.core.request import Entry, SamplingParameters, StoppingParameters, ValidRequest
from pytgi_router.core.request_stream import End, Event, Prefill, RequestStream, Token


def make_entry(entry_id: int, allocator: BlockAllocator, prompt: int = 3, new: int = 5) -> Entry:
    request = ValidRequest(
        inputs="hello",
        input_ids=list(range(10, 10 + prompt)),
        truncate=prompt,
        sampling=SamplingParameters(temperature=0.7, top_k=5, do_sample=True, seed=42),
        stopping=StoppingParameters(max_new_tokens=new, stop_sequences=["\n"]),
        top_n_tokens=2,
    )
    entry = Entry(entry_id, request, RequestStream(), request_pb(entry_id, request))
    entry.blocks = allocator.allocate(entry.total_tokens)
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


def test_build_batch_carries_blocks_and_parameters() -> None:
    allocator = BlockAllocator(20, 4)
    a, b = make_entry(7, allocator, prompt=3, new=5), make_entry(8, allocator, prompt=9, new=8)
    batch = build_batch(3, [a, b], block_size=4)
    assert batch.id == 3 and batch.size == 2
    assert [r.id for r in batch.requests] == [7, 8]
    assert list(batch.requests[0].blocks) == a.blocks and len(a.blocks or []) == 2
    assert len(batch.requests[1].blocks) == 5
    assert batch.max_blocks == 5 and batch.max_tokens == 7 * 4
    req = batch.requests[0]
    assert list(req.input_ids) == [10, 11, 12]
    assert req.parameters.seed == 42 and req.parameters.do_sample
    assert req.parameters.top_k == 5 and math.isclose(req.parameters.temperature, 0.7, rel_tol=1e-6)
    assert req.stopping_parameters.max_new_tokens == 5
    assert list(req.stopping_parameters.stop_sequences) == ["\n"]
    assert req.top_n_tokens == 2


def test_request_pb_rejects_values_the_wire_cannot_carry() -> None:
    request = ValidRequest("x", [1], 1, SamplingParameters(seed=2**64), StoppingParameters(1))
    with pytest.raises(ValueError):
        request_pb(0, request)


def test_route_generation_makes_tokens_then_end_with_timestamps() -> None:
    allocator = BlockAllocator(20, 4)
    entry = make_entry(1, allocator)
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


def test_route_generation_tolerates_missing_optional_lists() -> None:
    entry = make_entry(1, BlockAllocator(20, 4))
    g = generate_pb2.Generation(request_id=1, tokens=generate_pb2.Tokens(ids=[3]))
    assert not route_generation(entry, g, now=1.0)
    entry.stream.fail(GenerationError("stop reading"))
    with pytest.raises(GenerationError):
        drain(entry.stream)


def make_running(n: int) -> tuple[RunningBatch, list[Entry], list[int]]:
    allocator = BlockAllocator(50, 4)
    released: list[int] = []
    running = RunningBatch(allocator, lambda e: released.append(e.id))
    entries = [make_entry(i, allocator) for i in range(n)]
    running.add(entries)
    return running, entries, released


def cached(*ids: int) -> generate_pb2.CachedBatch:
    return generate_pb2.CachedBatch(id=0, request_ids=ids, size=len(ids))


def test_step_with_no_change_needs_no_filter() -> None:
    running, _, released = make_running(3)
    assert running.reserved_tokens == 3 * 2 * 4
    kept = running.apply_step([generation(0, 1), generation(1, 1), generation(2, 1)],
                              cached(0, 1, 2))
    assert kept is None and released == [] and len(running) == 3


def test_finished_request_is_retired_and_filtered_out() -> None:
    running, entries, released = make_running(3)
    kept = running.apply_step([generation(0, 1), generation(1, 2, final="x"), generation(2, 1)],
                              cached(0, 1, 2))
    assert kept == [0, 2]
    assert released == [1] and entries[1].blocks is None
    assert running.allocator.used_count == 4
    assert isinstance(drain(entries[1].stream)[-1], End)


def test_cancelled_request_keeps_its_blocks_until_the_step_ends() -> None:
    running, entries, released = make_running(2)
    entries[0].stream.cancel()
    running.mark_cancelled(0)
    assert running.allocator.used_count == 4, "blocks stay reserved while the shard holds them"
    kept = running.apply_step([generation(0, 1), generation(1, 1)], cached(0, 1))
    assert kept == [1] and released == [0]
    assert running.allocator.used_count == 2


def test_all_finished_means_drop_the_batch() -> None:
    running, _, _ = make_running(2)
    kept = running.apply_step([generation(0, 1, final="a"), generation(1, 1, final="b")],
                              cached(0, 1))
    assert kept == [] and len(running) == 0 and running.allocator.used_count == 0


def test_requests_the_shard_lost_end_incomplete() -> None:
    running, entries, released = make_running(3)
    # The shard returns no batch although request 2 never finished.
    running.apply_step([generation(0, 1, final="a"), generation(1, 1, final="b")], None)
    assert sorted(released) == [0, 1, 2] and running.allocator.used_count == 0
    with pytest.raises(IncompleteGenerationError):
        drain(entries[2].stream)
    running2, entries2, _ = make_running(2)
    assert running2.apply_step([generation(0, 1)], cached(0)) == [0]
    with pytest.raises(IncompleteGenerationError):
        drain(entries2[1].stream)


def test_fail_all_fails_every_stream_and_frees_everything() -> None:
    running, entries, released = make_running(3)
    running.fail_all(GenerationError("Server error: gone"))
    assert sorted(released) == [0, 1, 2] and running.allocator.used_count == 0
    assert running.cached is None and running.reserved_tokens == 0
    for entry in entries:
        with pytest.raises(GenerationError, match="gone"):
            drain(entry.stream)

"""Queue.next_batch: FIFO admission under the prefill, KV-token, block and size budgets."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pytgi_router.core.batch_state import request_pb
from pytgi_router.core.block_allocator import BlockAllocator
from pytgi_router.core.queue import Queue
from pytgi_router.core.request import Entry, SamplingParameters, StoppingParameters, ValidRequest
from pytgi_router.core.request_stream import RequestStream


def make_entry(entry_id: int, prompt: int, new_tokens: int) -> Entry:
    request = ValidRequest(
        inputs="x" * prompt,
        input_ids=list(range(1, prompt + 1)),
        truncate=prompt,
        sampling=SamplingParameters(),
        stopping=StoppingParameters(max_new_tokens=new_tokens),
    )
    return Entry(entry_id, request, RequestStream(), request_pb(entry_id, request))


def make_queue(num_blocks: int = 101, block_size: int = 4, *sizes: tuple[int, int]) -> Queue:
    queue = Queue(BlockAllocator(num_blocks, block_size))
    for i, (prompt, new) in enumerate(sizes):
        queue.append(make_entry(i, prompt, new))
    return queue


def ids(batch: list[Entry] | None) -> list[int]:
    assert batch is not None
    return [e.id for e in batch]


def test_takes_everything_that_fits_in_fifo_order_with_blocks() -> None:
    queue = make_queue(101, 4, (5, 3), (4, 4), (1, 1))
    batch = queue.next_batch(None, None, 100, 10_000)
    assert ids(batch) == [0, 1, 2]
    assert batch is not None
    assert [len(e.blocks or []) for e in batch] == [2, 2, 1]
    assert len(queue) == 0
    assert queue.allocator.used_count == 5


def test_empty_queue_gives_none() -> None:
    assert make_queue().next_batch(None, None, 100, 100) is None


def test_prefill_budget_stops_admission_without_skipping() -> None:
    queue = make_queue(101, 4, (6, 1), (6, 1), (1, 1))
    # The third would fit, but FIFO: nobody overtakes the second.
    assert ids(queue.next_batch(None, None, 10, 10_000)) == [0]
    assert len(queue) == 2
    assert ids(queue.next_batch(None, None, 10, 10_000)) == [1, 2]


def test_token_budget_counts_whole_blocks() -> None:
    # Each request needs 5 tokens -> 2 blocks of 4 -> 8 reserved tokens.
    queue = make_queue(101, 4, (3, 2), (3, 2), (3, 2))
    assert ids(queue.next_batch(None, None, 100, 16)) == [0, 1]


def test_allocator_is_the_hard_limit() -> None:
    # 6 usable blocks of 4 tokens; each request needs 3 blocks.
    queue = make_queue(7, 4, (8, 4), (8, 4), (8, 4))
    assert ids(queue.next_batch(None, None, 1000, 10_000)) == [0, 1]
    assert queue.allocator.free_count == 0
    assert queue.next_batch(None, None, 1000, 10_000) is None
    assert len(queue) == 1


def test_max_size() -> None:
    queue = make_queue(101, 4, (1, 1), (1, 1), (1, 1))
    assert ids(queue.next_batch(None, 2, 100, 1000)) == [0, 1]
    assert queue.next_batch(None, 0, 100, 1000) is None
    assert len(queue) == 1


def test_min_size_not_met_returns_none_and_frees_tentative_blocks() -> None:
    queue = make_queue(101, 4, (6, 2), (6, 2), (6, 2))
    # Only one fits in the prefill budget, two are required.
    assert queue.next_batch(2, None, 8, 1000) is None
    assert len(queue) == 3
    assert queue.allocator.used_count == 0
    assert all(e.blocks is None for e in queue.drain())


def test_min_size_larger_than_queue() -> None:
    queue = make_queue(101, 4, (1, 1))
    assert queue.next_batch(2, None, 100, 1000) is None
    assert ids(queue.next_batch(1, None, 100, 1000)) == [0]


@pytest.mark.parametrize(("prefill", "tokens"), [(0, 100), (100, 0), (-5, 100), (100, -8)])
def test_exhausted_budgets_give_none(prefill: int, tokens: int) -> None:
    queue = make_queue(101, 4, (1, 1))
    assert queue.next_batch(None, None, prefill, tokens) is None
    assert len(queue) == 1


def test_cancelled_entries_are_dropped() -> None:
    queue = make_queue(101, 4, (1, 1), (1, 1), (1, 1))
    entries = {e.id: e for e in queue.drain()}
    for entry in entries.values():
        queue.append(entry)
    entries[0].stream.cancel()
    entries[2].stream.cancel()
    assert ids(queue.next_batch(None, None, 100, 1000)) == [1]
    assert len(queue) == 0
    assert queue.allocator.used_count == 1


def test_remove() -> None:
    queue = make_queue(101, 4, (1, 1), (1, 1))
    removed = queue.remove(0)
    assert removed is not None and removed.id == 0
    assert queue.remove(0) is None
    assert 1 in queue and 0 not in queue


@settings(max_examples=100, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 30)), min_size=1, max_size=20),
    num_blocks=st.integers(2, 40),
    prefill=st.integers(1, 80),
    token_budget=st.integers(1, 200),
    max_size=st.one_of(st.none(), st.integers(0, 6)),
    min_size=st.one_of(st.none(), st.integers(0, 6)),
)
def test_admission_never_exceeds_a_budget(
    sizes: list[tuple[int, int]],
    num_blocks: int,
    prefill: int,
    token_budget: int,
    max_size: int | None,
    min_size: int | None,
) -> None:
    queue = make_queue(num_blocks, 4, *sizes)
    before = len(queue)
    batch = queue.next_batch(min_size, max_size, prefill, token_budget)
    allocator = queue.allocator
    if batch is None:
        assert len(queue) == before and allocator.used_count == 0
        return
    assert ids(batch) == list(range(len(batch))), "FIFO prefix"
    assert sum(len(e.request.input_ids) for e in batch) <= prefill
    assert sum(len(e.blocks or []) for e in batch) * 4 <= token_budget
    assert max_size is None or len(batch) <= max_size
    assert min_size is None or len(batch) >= min_size
    assert allocator.used_count == sum(len(e.blocks or []) for e in batch)
    for entry in batch:
        assert entry.blocks is not None
        assert len(entry.blocks) * 4 >= entry.total_tokens
    assert len(queue) == before - len(batch)

"""Queue: FIFO order, O(1) removal, a preempted entry back at the head. (Admission from it is
step_plan's: tests/unit/router/core/test_step_plan.py.)"""

from __future__ import annotations

from pytgi_proto.parameters import neutral_sampling
from pytgi_router.core.batch_wire import request_pb
from pytgi_router.core.queue import Queue
from pytgi_router.core.request import Entry, StoppingParameters, ValidRequest
from pytgi_router.core.request_stream import RequestStream


def make_entry(entry_id: int, prompt: int, new_tokens: int) -> Entry:
    request = ValidRequest(
        inputs="x" * prompt,
        input_ids=list(range(1, prompt + 1)),
        truncate=prompt,
        sampling=neutral_sampling(),
        stopping=StoppingParameters(max_new_tokens=new_tokens),
    )
    return Entry(entry_id, request, RequestStream(), request_pb(entry_id, request))


def test_fifo_order_and_removal() -> None:
    queue = Queue()
    for i in range(4):
        queue.append(make_entry(i, 1, 1))
    removed = queue.remove(1)
    assert removed is not None and removed.id == 1
    assert queue.remove(1) is None
    assert [e.id for e in queue] == [0, 2, 3] and len(queue) == 3
    assert 2 in queue and 1 not in queue


def test_preempted_entries_go_back_to_the_head_oldest_first() -> None:
    queue = Queue()
    queue.append(make_entry(5, 1, 1))
    # The scheduler pushes its victims newest first: the oldest ends at the head.
    for victim in (make_entry(3, 1, 1), make_entry(1, 1, 1)):
        queue.push_front(victim)
    assert [e.id for e in queue] == [1, 3, 5]


def test_drain_empties_the_queue() -> None:
    queue = Queue()
    queue.append(make_entry(0, 1, 1))
    assert [e.id for e in queue.drain()] == [0] and len(queue) == 0


def test_an_entry_carries_its_sequence_from_the_prompt() -> None:
    entry = make_entry(0, 3, 5)
    assert entry.tokens == [1, 2, 3] and entry.tokens is not entry.request.input_ids
    entry.tokens.append(9)
    assert entry.generated == [9] and entry.request.input_ids == [1, 2, 3]
    assert entry.total_tokens == 8

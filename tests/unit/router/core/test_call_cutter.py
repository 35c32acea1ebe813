"""Cutting a multi-step Decode call short for a newcomer or a cancel (router/core/call_cutter.py,
decode_steps.cut_short_wanted): the rule, then the real Scheduler against the model of the
shards (model_shard.py), a newcomer arriving between a call's steps."""

from __future__ import annotations

from pytgi_router.core.decode_steps import cut_short_wanted
from pytgi_router.core.request import Entry
from pytgi_router.core.shard_client import ShardCallError
from pytgi_router.core.step_plan import Budgets
from tests.unit.router.core.test_decode_steps import Harness
from tests.unit.router.model_shard import reference

CHUNKING = Budgets(max_batch_prefill_tokens=64, max_batch_total_tokens=1024, max_decode_steps=8)
NO_CHUNKING = Budgets(max_batch_prefill_tokens=64, max_batch_total_tokens=1024,
                      max_decode_steps=8, chunking=False, waiting_served_ratio=1.2,
                      max_waiting_tokens=20)


def test_a_call_is_cut_only_for_someone_waiting_who_may_join() -> None:
    assert not cut_short_wanted(CHUNKING, running=3, waiting=0, steps_since_admission=0)
    # Chunking shards mix a newcomer's prefill with the decode rows: always worth it.
    assert cut_short_wanted(CHUNKING, running=3, waiting=1, steps_since_admission=0)
    # Without chunking (a prefill pauses every stream), TGI's rule: a crowd, or a long wait.
    assert not cut_short_wanted(NO_CHUNKING, running=5, waiting=1, steps_since_admission=3)
    assert cut_short_wanted(NO_CHUNKING, running=5, waiting=6, steps_since_admission=3)
    assert cut_short_wanted(NO_CHUNKING, running=5, waiting=1, steps_since_admission=20)
    # Nobody running: a newcomer is always admitted.
    assert cut_short_wanted(NO_CHUNKING, running=0, waiting=1, steps_since_admission=0)


def arrive_after(h: Harness, done: int, prompt: list[int], max_new: int,
                 arrivals: list[Entry]) -> None:
    """A newcomer submitted (and the scheduler notified, as Infer does) once `done` steps of
    the next multi-step call ran; once only."""

    def between(steps_done: int) -> None:
        if steps_done == done and not arrivals:
            arrivals.append(h.submit(prompt, max_new))
            h.scheduler.notify()

    h.shard.between_steps = between


def test_a_newcomer_cuts_the_call_short_and_joins_in_the_next() -> None:
    h = Harness()
    a = h.submit([1, 2, 0], 30)
    h.step()  # a's Prefill
    late: list[Entry] = []
    arrive_after(h, 2, [2, 1, 1], 6, late)
    h.step()  # a call of 8 steps, cut after 2
    assert h.shard.calls == [8] and h.shard.ran == [2]
    assert h.shard.cuts == [1]
    assert h.scheduler.metrics.decode_cut_short._value.get() == 1
    assert h.scheduler.metrics.decode_steps._value.get() == 2
    # Steps since admission count the steps run (the admission rule of shards without
    # chunking counts steps, not calls).
    assert h.scheduler._steps_since_admission == 2
    assert len(h.scheduler.queue) == 1
    h.step()  # the newcomer's Prefill, with a's decode row
    assert len(h.scheduler.queue) == 0 and late[0].id in h.scheduler.running.entries
    h.shard.between_steps = None
    h.drain()
    assert h.tokens(a) == reference([1, 2, 0], 30)
    assert h.tokens(late[0]) == reference([2, 1, 1], 6)
    assert h.cache.free_count == h.cache.total
    assert h.shard.cuts == [1]


def test_a_cancel_cuts_the_call_short_and_the_request_leaves_after_it() -> None:
    h = Harness()
    a = h.submit([1, 2, 0], 30)
    b = h.submit([2, 1, 1], 30)
    h.step()  # their Prefill

    def between(steps_done: int) -> None:
        if steps_done == 2 and not b.stream.cancelled:
            b.stream.cancel()  # the client went away: Scheduler.cancel, as Infer wires it

    h.shard.between_steps = between
    h.step()  # a call of 8 steps, cut after 2
    h.shard.between_steps = None
    assert h.shard.calls == [8] and h.shard.ran == [2] and h.shard.cuts == [1]
    h.drain()
    assert b.id not in h.scheduler.running.entries
    assert h.tokens(a) == reference([1, 2, 0], 30)
    assert h.cache.free_count == h.cache.total


def test_one_cut_short_per_call_however_many_arrive() -> None:
    h = Harness()
    a = h.submit([1, 2, 0], 30)
    h.step()
    arrivals: list[Entry] = []

    def between(steps_done: int) -> None:
        if steps_done in (1, 2):
            arrivals.append(h.submit([2, 2], 3))
            h.scheduler.notify()

    h.shard.between_steps = between
    h.step()
    h.shard.between_steps = None
    assert h.shard.ran == [1] and len(h.shard.cuts) == 1
    h.drain()
    assert h.tokens(a) == reference([1, 2, 0], 30)
    assert all(h.tokens(e) == reference([2, 2], 3) for e in arrivals)


def test_a_newcomer_between_calls_cuts_nothing() -> None:
    h = Harness()
    a = h.submit([1, 2, 0], 20)
    h.step()
    h.step()  # 8 steps, nobody came
    b = h.submit([1, 1], 4)
    h.scheduler.notify()  # no call in flight
    h.drain()
    assert h.shard.cuts == []
    assert h.scheduler.metrics.decode_cut_short._value.get() == 0
    assert h.tokens(a) == reference([1, 2, 0], 20)
    assert h.tokens(b) == reference([1, 1], 4)


def test_a_call_that_ends_because_its_rows_finished_is_not_counted_as_cut() -> None:
    h = Harness()
    h.submit([1, 2, 0], 4)
    h.drain()
    # 1 token from the Prefill, then a call of 8 that ran 3 and left no batch.
    assert h.shard.ran == [3]
    assert h.scheduler.metrics.decode_cut_short._value.get() == 0


def test_a_newcomer_admission_keeps_out_does_not_cut() -> None:
    """Shards without chunking: one newcomer for five running rows waits (TGI's ratio), so
    the call runs its 8 steps."""
    h = Harness()
    h.scheduler.budgets = h.scheduler._cutter.budgets = NO_CHUNKING
    rows = [h.submit([i % 3, 1], 40) for i in range(5)]
    h.step()  # their Prefill
    late: list[Entry] = []
    arrive_after(h, 1, [2, 2], 3, late)
    h.step()
    assert h.shard.cuts == [] and h.shard.ran[0] > 1
    h.shard.between_steps = None
    h.drain()
    for row in rows:
        assert h.tokens(row) == reference(list(row.request.input_ids), 40)
    assert h.tokens(late[0]) == reference([2, 2], 3)


def test_a_failed_cut_short_lets_the_call_run_to_its_end() -> None:
    h = Harness()
    a = h.submit([1, 2, 0], 30)
    h.step()

    async def refused(call_id: int, timeout: float | None = None) -> None:
        raise ShardCallError("Server error: unimplemented")

    h.shard.cut_short = refused  # type: ignore[method-assign]
    late: list[Entry] = []
    arrive_after(h, 2, [2, 1, 1], 6, late)
    h.step()
    assert h.shard.ran == [8]
    assert h.scheduler.metrics.decode_cut_short._value.get() == 0
    h.shard.between_steps = None
    h.drain()
    assert h.tokens(a) == reference([1, 2, 0], 30)
    assert h.tokens(late[0]) == reference([2, 1, 1], 6)

"""Multi-step decode's policy (router/core/decode_steps.py): when a Decode call may run more than
one step, and the blocks that make every step's KV fit. Then the real Scheduler against the
model of the shards (model_shard.py, which checks every KV write falls in the granted blocks):
the calls it makes and the tokens every stream gets."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import cast

from hypothesis import given
from hypothesis import strategies as st

from pytgi_proto.parameters import neutral_sampling
from pytgi_router.core.decode_steps import (
    StepTime,
    covered_steps,
    grow_for_steps,
    steps_in_time,
    steps_wanted,
)
from pytgi_router.core.prefix_cache import PrefixCache
from pytgi_router.core.queue import Queue
from pytgi_router.core.request import Entry, StoppingParameters, ValidRequest
from pytgi_router.core.request_stream import End, RequestStream, Token
from pytgi_router.core.scheduler import Scheduler
from pytgi_router.core.shard_client import ShardCallError, ShardClient
from pytgi_router.core.step_plan import Budgets, Chunk, StepPlan, kv_tokens
from pytgi_router.metrics import Metrics
from tests.unit.router.model_shard import ModelShard, reference


def entry(entry_id: int, prompt: list[int], max_new: int) -> Entry:
    request = ValidRequest(
        inputs="x", input_ids=prompt, truncate=len(prompt), sampling=neutral_sampling(),
        stopping=StoppingParameters(max_new_tokens=max_new),
    )
    from pytgi_router.core.batch_wire import request_pb

    e = Entry(entry_id, request, RequestStream(), request_pb(entry_id, request))
    return e


def plan(chunks: list[Chunk] | None = None, preempted: list[Entry] | None = None) -> StepPlan:
    return StepPlan(grants=[], preempted=preempted or [], chunks=chunks or [], newcomers=[],
                    cancelled=[])


BUDGETS = Budgets(max_batch_prefill_tokens=64, max_batch_total_tokens=1024, max_decode_steps=8)


def wanted(budgets: Budgets = BUDGETS, step: StepPlan | None = None, prefilling: int = 0,
           waiting: int = 0, admit: bool = True, since: int = 0, cancelling: bool = False) -> int:
    return steps_wanted(budgets, step or plan(), prefilling, waiting, admit, since, cancelling)


def test_many_steps_only_when_nothing_can_join_leave_or_change() -> None:
    assert wanted() == 8
    e = entry(1, [1, 2], 4)
    assert wanted(step=plan(chunks=[Chunk.of(e, 0, 2)])) == 1  # a prompt chunk: a Prefill
    assert wanted(step=plan(preempted=[e])) == 1
    assert wanted(prefilling=1) == 1
    assert wanted(waiting=1) == 1  # a newcomer waits (blocks short): it joins after one step
    assert wanted(cancelling=True) == 1  # a cancelled row leaves after the next step
    speculating = Budgets(max_batch_prefill_tokens=64, max_batch_total_tokens=1024,
                          max_decode_steps=8, speculate=2)
    assert wanted(budgets=speculating) == 1
    off = Budgets(max_batch_prefill_tokens=64, max_batch_total_tokens=1024, max_decode_steps=1)
    assert wanted(budgets=off) == 1


def test_closed_admission_caps_the_steps_at_when_it_opens() -> None:
    """Shards without chunking: waiting requests join after max_waiting_tokens steps."""
    budgets = Budgets(max_batch_prefill_tokens=64, max_batch_total_tokens=1024,
                      max_decode_steps=8, chunking=False, max_waiting_tokens=20)
    assert wanted(budgets=budgets, waiting=1, admit=False, since=0) == 8
    assert wanted(budgets=budgets, waiting=1, admit=False, since=17) == 3
    assert wanted(budgets=budgets, waiting=1, admit=False, since=20) == 1
    assert wanted(budgets=budgets, waiting=1, admit=True) == 1


def test_a_call_runs_the_steps_its_time_holds() -> None:
    """--max-decode-call-ms: fast steps run many per call, slow ones few, a batch grown since
    the last call is assumed proportionally slower, and nothing is assumed before a timing."""
    fast, slow = StepTime(0.0022, 1), StepTime(0.030, 64)
    assert steps_in_time(32, 100, fast, 1) == 32  # 45 fit: capped at --max-decode-steps
    assert steps_in_time(64, 100, fast, 1) == 45
    assert steps_in_time(32, 100, slow, 64) == 3
    assert steps_in_time(32, 100, fast, 8) == 5  # 8 rows now: 17.6 ms a step at most
    assert steps_in_time(32, 100, fast, 1) == steps_in_time(32, 100, StepTime(0.0022, 4), 1)
    assert steps_in_time(32, 10, StepTime(0.5, 1), 1) == 1  # slower than the bound: one step
    assert steps_in_time(32, 100, None, 1) == 1  # untimed: one step measures it
    assert steps_in_time(32, 0, None, 1) == 32  # 0: no bound
    assert steps_in_time(1, 100, fast, 1) == 1


@given(most=st.integers(1, 64), call_ms=st.integers(0, 1000), seconds=st.floats(1e-5, 2.0),
       then=st.integers(1, 256), now=st.integers(1, 256))
def test_steps_in_time_stay_in_bounds(most: int, call_ms: int, seconds: float, then: int,
                                      now: int) -> None:
    k = steps_in_time(most, call_ms, StepTime(seconds, then), now)
    assert 1 <= k <= most
    if call_ms and k > 1:  # more than one step only when they fit the bound
        assert k * seconds * max(1.0, now / then) <= call_ms / 1e3 + 1e-9


@given(prompt=st.integers(1, 40), max_new=st.integers(1, 40), block_size=st.integers(1, 16),
       spare=st.integers(0, 3), most=st.integers(1, 16))
def test_covered_steps_is_what_the_blocks_hold(
    prompt: int, max_new: int, block_size: int, spare: int, most: int
) -> None:
    e = entry(1, list(range(prompt)), max_new)
    e.tokens = list(range(prompt))
    blocks = -(-kv_tokens(e) // block_size) + spare
    e.blocks_held = blocks
    k = covered_steps(e, block_size, most)
    assert 1 <= k <= most
    assert kv_tokens(e, k - 1) <= blocks * block_size
    if k < most:
        assert kv_tokens(e, k) > blocks * block_size


@given(lengths=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 30)), min_size=1,
                        max_size=6),
       num_blocks=st.integers(8, 80), block_size=st.integers(1, 8), steps=st.integers(2, 16))
def test_grow_for_steps_covers_every_step_or_takes_nothing(
    lengths: list[tuple[int, int]], num_blocks: int, block_size: int, steps: int
) -> None:
    cache = PrefixCache(num_blocks, block_size, prefix_caching=False)
    running = []
    for i, (prompt, max_new) in enumerate(lengths):
        e = entry(i, list(range(prompt)), max_new)
        admission = cache.admit(i, e.tokens, kv_tokens(e) - prompt, False, 0)
        if admission is None:
            break
        e.blocks_held = len(admission.blocks)
        e.blocks_sent = e.blocks_held - 1 if e.blocks_held > 1 else 0
        running.append(e)
    if not running:
        return
    free = cache.free_count
    k, grants = grow_for_steps(cache, running, steps)
    assert 1 <= k <= steps
    for e in running:
        assert kv_tokens(e, k - 1) <= e.blocks_held * block_size
        assert e.blocks_held == len(cache.table(e.id))
    if grants is None:
        assert cache.free_count == free
    else:
        assert k == steps
        granted = {e.id: blocks for e, blocks in grants}
        for e in running:
            assert granted.get(e.id, ()) == cache.table(e.id, e.blocks_sent)


# The real Scheduler against the model of the shards.


class Harness:
    def __init__(self, num_blocks: int = 64, block_size: int = 4, max_decode_steps: int = 8,
                 max_batch_size: int | None = None) -> None:
        self.loop = asyncio.new_event_loop()
        self.cache = PrefixCache(num_blocks, block_size)
        self.shard = ModelShard(self.cache)
        budgets = Budgets(max_batch_prefill_tokens=64,
                          max_batch_total_tokens=num_blocks * block_size,
                          max_decode_steps=max_decode_steps, max_batch_size=max_batch_size)
        self.scheduler = Scheduler(cast(ShardClient, self.shard), Queue(), self.cache, budgets,
                                   Metrics(), lambda e: None)
        self.entries: list[Entry] = []

    def submit(self, prompt: list[int], max_new: int) -> Entry:
        e = entry(len(self.entries), prompt, max_new)
        scheduler = self.scheduler
        e.stream = RequestStream(lambda _, i=e.id: scheduler.cancel(i))
        self.entries.append(e)
        scheduler.queue.append(e)
        return e

    def step(self) -> bool:
        return self.loop.run_until_complete(self.scheduler._step())

    def drain(self) -> None:
        for _ in range(1000):
            if not self.step():
                return
        raise AssertionError("never drained")

    def tokens(self, e: Entry) -> list[int]:
        events = list(e.stream._events)
        assert isinstance(events[-1], End), f"request {e.id} never ended"
        return [ev.token.id for ev in events if isinstance(ev, Token | End)]


def test_a_lone_batch_decodes_k_steps_per_call_with_the_same_tokens() -> None:
    h = Harness()
    a = h.submit([1, 2, 0], 20)
    b = h.submit([2, 2], 13)
    h.drain()
    assert h.tokens(a) == reference([1, 2, 0], 20)
    assert h.tokens(b) == reference([2, 2], 13)
    # The Prefill's token, then 19 for a: 8 + 8 + 3 (b finished in the second call).
    assert h.shard.calls == [8, 8, 8]
    assert h.cache.free_count == h.cache.total


def test_the_scheduler_times_its_calls_and_bounds_the_next_by_time() -> None:
    """--max-decode-call-ms: one step until a call was timed, then as many as the bound holds
    at the last call's time per step (a slow step, 30 ms: 3 steps in 100 ms)."""
    h = Harness()
    h.scheduler.budgets = dataclasses.replace(h.scheduler.budgets, max_decode_call_ms=100)
    a = h.submit([1, 2, 0], 20)
    h.step()  # the Prefill
    h.step()  # untimed: one step
    assert h.shard.calls == [1] and h.scheduler._step_time is not None
    h.step()  # the model shard answers in microseconds: 8, --max-decode-steps
    assert h.shard.calls == [1, 8]
    h.scheduler._step_time = StepTime(0.030, 1)
    h.step()
    assert h.shard.calls == [1, 8, 3]
    h.drain()
    assert h.tokens(a) == reference([1, 2, 0], 20)


def test_a_newcomer_waiting_for_blocks_keeps_one_step_per_call() -> None:
    """Blocks short: the newcomer stays queued, and every call is one step until it joins."""
    h = Harness(num_blocks=6, block_size=2, max_batch_size=None)
    a = h.submit([1, 2, 0, 1], 5)  # 4 + 5 tokens: 5 blocks of 2 at most
    h.step()  # its Prefill
    late = h.submit([2, 2, 2, 2, 2, 2], 2)  # needs 4 blocks: waits for a to end
    h.drain()
    assert h.tokens(a) == reference([1, 2, 0, 1], 5)
    assert h.tokens(late) == reference([2, 2, 2, 2, 2, 2], 2)
    # a's four decode steps ran one per call while `late` waited; `late`'s one decode after
    # its Prefill ran alone (nothing waiting): it asks for 8 and ends after the first.
    assert h.shard.calls == [1, 1, 1, 1, 8]


def test_k_steps_never_take_a_block_the_pool_does_not_have() -> None:
    """A pool too small to grow every row for 8 steps: k is what the blocks held cover."""
    h = Harness(num_blocks=7, block_size=2)
    a = h.submit([1], 8)
    b = h.submit([2], 8)
    h.drain()
    assert h.tokens(a) == reference([1], 8)
    assert h.tokens(b) == reference([2], 8)
    # The first call's rows hold blocks for a few steps, not 8 (the model of the shards
    # checks every write falls in them); the last, a lone row whose blocks hold its last
    # position, asks for 8 again.
    assert 1 < h.shard.calls[0] < 8
    assert h.shard.calls[-1] == 8


def test_a_cancel_during_a_call_leaves_at_the_next_boundary() -> None:
    h = Harness()
    a = h.submit([1, 2], 30)
    b = h.submit([2, 1], 30)
    h.step()  # Prefill
    h.step()  # 8 steps
    a.stream.cancel()
    assert h.scheduler.running.cancelling
    h.step()  # one step: a leaves after it
    assert a.id not in h.scheduler.running.entries
    h.drain()
    # b: 1 + 8 + 1 + 8 + 8 tokens, then a call of 8 that ends after 4 (its last token).
    assert h.shard.calls == [8, 1, 8, 8, 8]
    assert h.tokens(b) == reference([2, 1], 30)
    assert h.cache.free_count == h.cache.total


def test_a_failed_multi_step_call_fails_the_batch() -> None:
    h = Harness()
    a = h.submit([1, 2], 30)
    h.step()

    async def broken(*args: object, **kwargs: object) -> None:
        raise ShardCallError("Server error: boom")

    h.shard.decode = broken  # type: ignore[method-assign]
    h.step()
    assert len(h.scheduler.running) == 0
    assert a.stream._error is not None
    assert h.cache.free_count == h.cache.total

"""The --max-loras cap in the scheduler: a step never carries more distinct LoRA adapters than
the shards hold on the device; a newcomer whose adapter would pass it waits at the head of the
queue (FIFO), the base model takes no slot, and once a live adapter's requests end the waiting
one is admitted. Also the AdapterTable: indices, load keys, in-flight counts."""

from __future__ import annotations

import asyncio
import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from pytgi_proto.parameters import neutral_sampling
from pytgi_router.core.adapter_cap import fits_adapter_cap, live_adapters
from pytgi_router.core.batch_wire import request_pb
from pytgi_router.core.lora_adapters import AdapterTable
from pytgi_router.core.prefix_cache import PrefixCache
from pytgi_router.core.request import Entry, StoppingParameters, ValidRequest
from pytgi_router.core.request_stream import RequestStream
from pytgi_router.core.step_plan import Budgets, plan_step

BS = 4


def entry(entry_id: int, adapter: int) -> Entry:
    ids = [1 + (entry_id + i) % 50 for i in range(6)]
    request = ValidRequest(
        inputs="x", input_ids=ids, truncate=len(ids), sampling=neutral_sampling(),
        stopping=StoppingParameters(max_new_tokens=4), adapter_index=adapter,
        adapter_key=adapter,
    )
    return Entry(entry_id, request, RequestStream(), request_pb(entry_id, request))


def budgets(max_loras: int) -> Budgets:
    return Budgets(max_batch_prefill_tokens=10**6, max_batch_total_tokens=10**6,
                   max_loras=max_loras)


def test_fits_adapter_cap() -> None:
    assert fits_adapter_cap({1, 2}, 0, 2)  # the base model takes no slot
    assert fits_adapter_cap({1, 2}, 2, 2)  # already in the step
    assert not fits_adapter_cap({1, 2}, 3, 2)
    assert fits_adapter_cap({1}, 3, 2)
    assert fits_adapter_cap({1, 2}, 3, 0)  # no adapters served: nothing to keep
    assert fits_adapter_cap(None, 3, 1)


def test_a_newcomer_past_the_cap_waits_at_the_head_then_joins() -> None:
    cache = PrefixCache(200, BS, 199 * BS)
    running = [entry(0, 1), entry(1, 2)]
    first = plan_step(cache, budgets(2), [], [], running)
    assert first.newcomers == running
    waiting = [entry(2, 3), entry(3, 1), entry(4, 0)]
    plan = plan_step(cache, budgets(2), running, [], waiting)
    assert plan.newcomers == []  # FIFO: adapter 3 waits and nobody overtakes it
    plan = plan_step(cache, budgets(2), running[:1], [], waiting)  # adapter 2's request ended
    assert plan.newcomers == waiting


@settings(max_examples=150, deadline=None)
@given(cap=st.integers(1, 4), adapters=st.lists(st.integers(0, 6), min_size=1, max_size=12),
       live=st.integers(0, 4))
def test_no_step_carries_more_adapters_than_the_cap(cap: int, adapters: list[int],
                                                    live: int) -> None:
    """Whatever the queue, the admitted plus the live entries use at most `cap` adapters, and
    the admitted are a prefix of the queue (FIFO)."""
    cache = PrefixCache(400, BS, 399 * BS)
    entries = [entry(i, a) for i, a in enumerate(adapters)]
    running = plan_step(cache, budgets(cap), [], [], entries[:live]).newcomers
    assert len(live_adapters(running)) <= cap
    plan = plan_step(cache, budgets(cap), running, [], entries[len(running):])
    assert plan.newcomers == entries[len(running):len(running) + len(plan.newcomers)]
    assert len(live_adapters([*running, *plan.newcomers])) <= cap
    rest = entries[len(running) + len(plan.newcomers):]
    if rest:  # the head that stopped admission would have broken the cap
        assert not fits_adapter_cap(live_adapters([*running, *plan.newcomers]),
                                    rest[0].request.adapter_index, cap)


def test_the_adapter_table_reserves_indices_and_never_reuses_a_key() -> None:
    table = AdapterTable(("sql", "chat"), max_loras=2, runtime_updates=True)
    sql = table.get("sql")
    assert sql is not None and (sql.index, sql.key) == (1, 1)
    index = table.reserve()
    assert index == 3
    new = table.add("new", index, "/adapters/new")
    assert (new.index, new.key, new.source) == (3, 3, "/adapters/new")
    removed = table.remove("sql")
    assert removed == sql and table.get("sql") is None
    assert table.reserve() == 4  # index 1 stays reserved until the shards freed it
    table.release(4)
    table.release(1)
    again = table.add("sql", table.reserve(), "/adapters/sql2")
    assert again.index == 1 and again.key == 4  # the same index, a new key
    assert table.names() == ["sql", "chat", "new"]
    assert dataclasses.astuple(table.by_index(2))[:2] == ("chat", 2)  # type: ignore[arg-type]


def test_until_idle_waits_for_the_requests_in_flight() -> None:
    table = AdapterTable(("a",))

    async def run() -> list[str]:
        events: list[str] = []
        table.enter(10, 1)
        table.enter(11, 1)
        table.enter(11, 1)  # counted once
        table.enter(12, 0)  # the base model is not counted

        async def finish() -> None:
            await asyncio.sleep(0.06)
            table.leave(10)
            table.leave(10)  # a second leave does nothing
            events.append("one")
            await asyncio.sleep(0.06)
            table.leave(11)
            events.append("two")

        task = asyncio.ensure_future(finish())
        await table.until_idle(1)
        events.append("idle")
        await task
        return events

    assert asyncio.run(run()) == ["one", "two", "idle"]
    assert table.in_flight(1) == 0


def test_current_tells_a_load_from_a_later_one_at_the_same_index() -> None:
    table = AdapterTable(("a",))
    first = table.get("a")
    assert first is not None and table.current(1, first.key)
    table.remove("a")
    assert not table.current(1, first.key)
    table.release(1)
    again = table.add("a", table.reserve(), "/adapters/a2")
    assert again.index == 1 and table.current(1, again.key) and not table.current(1, first.key)

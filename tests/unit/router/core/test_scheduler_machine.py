"""The batching task under random submissions (fresh and repeated prompts), steps, refused
prefills and cancellations: the real Scheduler, planner and PrefixCache against a model of the
shards (model_shard.py) that checks every KV read and write.

What must hold whatever the order: the shards' block tables are the router's (grants reach them,
tables never change under them), a step writes only blocks its request alone holds, every read
finds the KV its sequence would have computed, the pool never holds a block no live table uses
(a repeated prompt costs its KV once), and every request that was neither cancelled nor refused
ends with exactly the tokens an uncached, unpreempted run gives.
"""

from __future__ import annotations

import asyncio
from typing import cast

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pytgi_proto.parameters import neutral_sampling
from pytgi_router.core.adapter_cap import live_adapters
from pytgi_router.core.batch_wire import request_pb
from pytgi_router.core.errors import GenerationError
from pytgi_router.core.prefix_cache import PrefixCache
from pytgi_router.core.queue import Queue
from pytgi_router.core.request import Entry, StoppingParameters, ValidRequest
from pytgi_router.core.request_stream import End, RequestStream, Token
from pytgi_router.core.scheduler import Scheduler
from pytgi_router.core.shard_client import ShardClient
from pytgi_router.core.step_plan import Budgets
from pytgi_router.metrics import Metrics
from tests.unit.router.model_shard import ModelShard, reference

PICK = st.integers(0, 1 << 16)
# A drain must be done by then: a request takes at most prompt + max_new steps.
DRAIN_STEPS = 2000


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.entries: dict[int, Entry] = {}
        self.released: dict[int, int] = {}
        self.prompts: list[list[int]] = []
        self.next_id = 0

    @initialize(
        num_blocks=st.integers(4, 24),
        block_size=st.integers(1, 3),
        caching=st.sampled_from([True, True, True, False]),
        prefill_budget=st.integers(1, 12),
        max_loras=st.integers(0, 3),
        # Multi-step decode (router/core/decode_steps.py): every step of a call must write only
        # blocks granted with it, and the outputs stay those of one step per call.
        max_decode_steps=st.sampled_from([1, 2, 3, 8]),
    )
    def setup(self, num_blocks: int, block_size: int, caching: bool, prefill_budget: int,
              max_loras: int, max_decode_steps: int) -> None:
        self.cache = PrefixCache(num_blocks, block_size, prefix_caching=caching)
        self.shard = ModelShard(self.cache)
        # LoRA adapters drawn per request when the shards serve some (--max-loras > 0).
        self.max_loras = max_loras
        budgets = Budgets(max_batch_prefill_tokens=prefill_budget,
                          max_batch_total_tokens=self.cache.total * block_size,
                          max_loras=max_loras, max_decode_steps=max_decode_steps)
        self.scheduler = Scheduler(cast(ShardClient, self.shard), Queue(), self.cache, budgets,
                                   Metrics(), self._release)

    def teardown(self) -> None:
        self.loop.close()

    # Helpers

    def _release(self, entry: Entry) -> None:
        self.released[entry.id] = self.released.get(entry.id, 0) + 1

    def _submit(self, prompt: list[int], max_new: int, adapter: int = 0) -> None:
        """As Infer.submit does, for a request any batch can hold (it checks that first)."""
        room = self.cache.total * self.cache.block_size - len(prompt)
        max_new = max(1, min(max_new, room))
        if room < 1:
            return
        entry_id = self.next_id
        self.next_id += 1
        request = ValidRequest(
            inputs="x", input_ids=prompt, truncate=len(prompt), sampling=neutral_sampling(),
            stopping=StoppingParameters(max_new_tokens=max_new),
            adapter_index=adapter if self.max_loras else 0,
            adapter_key=adapter if self.max_loras else 0,
        )
        scheduler = self.scheduler
        stream = RequestStream(lambda _: scheduler.cancel(entry_id))
        entry = Entry(entry_id, request, stream, request_pb(entry_id, request))
        self.entries[entry_id] = entry
        self.prompts.append(prompt)
        scheduler.queue.append(entry)

    def _step(self) -> bool:
        return self.loop.run_until_complete(self.scheduler._step())

    def _drain(self) -> None:
        """Steps until nothing is left, then checks every request's end (and forgets them)."""
        for _ in range(DRAIN_STEPS):
            if not self._step():
                break
        assert len(self.scheduler.queue) == 0 and len(self.scheduler.running) == 0
        assert self.cache.free_count == self.cache.total and len(self.cache) == 0
        for entry_id, entry in self.entries.items():
            assert self.released.get(entry_id, 0) <= 1, f"request {entry_id} released twice"
            self._check_end(entry)
        self.entries.clear()

    def _check_end(self, entry: Entry) -> None:
        events, error = self.loop.run_until_complete(_read_all(entry.stream))
        if entry.stream.cancelled:
            return
        if entry.id in self.shard.refused and isinstance(error, GenerationError):
            return
        assert error is None, f"request {entry.id} failed: {error!r}"
        assert events and isinstance(events[-1], End), f"request {entry.id} never ended"
        tokens = [e.token.id for e in events if isinstance(e, Token)]
        request = entry.request
        assert tokens == reference(request.input_ids, request.stopping.max_new_tokens)

    # Rules

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=10), max_new=st.integers(1, 8),
          adapter=st.integers(0, 4))
    def submit(self, prompt: list[int], max_new: int, adapter: int) -> None:
        self._submit(prompt, max_new, adapter)

    @precondition(lambda self: self.prompts)
    @rule(index=PICK, max_new=st.integers(1, 8))
    def submit_again(self, index: int, max_new: int) -> None:
        """A repeated prompt: greedy, it generates what its earlier runs did."""
        self._submit(self.prompts[index % len(self.prompts)], max_new)

    @rule(refuse=st.sampled_from([False, False, False, True]))
    def step(self, refuse: bool) -> None:
        """One step of the batching task; `refuse`: the shards refuse it if it is a Prefill
        (INVALID_ARGUMENT before touching anything), which fails only its chunks' requests."""
        self.shard.refuse_next = refuse
        self._step()
        self.shard.refuse_next = False

    @rule(after=st.integers(1, 7), prompt=st.lists(st.integers(0, 2), min_size=1, max_size=10),
          max_new=st.integers(1, 8))
    def step_with_a_newcomer_mid_call(self, after: int, prompt: list[int], max_new: int) -> None:
        """One step during which, if it is a multi-step Decode, a request arrives after `after`
        of its steps (submitted and notified, as Infer does): the call may be cut short there
        (router/core/call_cutter.py); outputs and KV writes stay as checked everywhere else."""

        def between(done: int) -> None:
            if done == after:
                self._submit(prompt, max_new)
                self.scheduler.notify()

        self.shard.between_steps = between
        try:
            self._step()
        finally:
            self.shard.between_steps = None

    @invariant()
    def a_step_never_holds_more_adapters_than_the_device(self) -> None:
        """--max-loras: the live entries (what the next step carries) use at most that many
        distinct LoRA adapters (router/core/adapter_cap.py)."""
        if getattr(self, "scheduler", None) is None or not self.max_loras:
            return
        running = self.scheduler.running
        live = live_adapters([*running.entries.values(), *running.prefilling.values()])
        assert len(live) <= self.max_loras, live

    @precondition(lambda self: self.entries)
    @rule()
    def drain(self) -> None:
        """Steps until nothing is left: every request ended as it should, nothing is held."""
        self._drain()

    @precondition(lambda self: self.entries)
    @rule(index=PICK)
    def cancel(self, index: int) -> None:
        ids = sorted(self.entries)
        self.entries[ids[index % len(ids)]].stream.cancel()

    # Invariants

    @invariant()
    def the_shards_tables_are_the_routers(self) -> None:
        """A request in the shards' batch holds its router table's first `blocks_sent` blocks
        (the rest go out as grants with the next step)."""
        if not hasattr(self, "scheduler"):
            return
        running = self.scheduler.running.entries
        for rid, row in self.shard.rows.items():
            entry = running[rid]
            assert len(row.table) == entry.blocks_sent
            assert tuple(row.table) == self.cache.table(rid)[:entry.blocks_sent]

    @invariant()
    def the_pool_holds_one_copy(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        snap = self.cache.snapshot()
        assert set(snap.pins) <= set(snap.refs)
        assert self.cache.used_count == len({b for t in snap.tables.values() for b in t})

    @invariant()
    def live_requests_hold_the_blocks(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        running = self.scheduler.running
        live = set(running.entries) | set(running.prefilling)
        assert set(self.cache.snapshot().tables) == live
        for entry in [*running.entries.values(), *running.prefilling.values()]:
            assert entry.blocks_held == len(self.cache.table(entry.id))


async def _read_all(stream: RequestStream) -> tuple[list[object], Exception | None]:
    """The events left in a closed stream, and the error it ended with (if any)."""
    events: list[object] = []
    try:
        async for event in stream:
            events.append(event)
    except Exception as err:  # an InferError: the request failed
        return events, err
    return events, None


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)

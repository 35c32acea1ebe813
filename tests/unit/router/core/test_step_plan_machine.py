"""The planner (step_plan.plan_step) over its whole contract, not only the states today's
Scheduler reaches: between two plans any running entry may have advanced or not, and a step's
grants may have reached the shards or not (a refused step leaves them for the next one). Checked
after every plan: the grants are exactly the surviving entries' unsent table tails, the victims
are the newest live entries and hold nothing, everyone left holds the KV its step needs, and the
newcomers came from the head of the queue.

With speculation (`speculate` drafts per sequence and step) a step may advance a sequence by
up to speculate + 1 tokens (the drafts kept, then the target's token): every running entry then
holds room for the drafts' slots too, and only KV of kept tokens is committed.

(A refused step followed by growth that preempts an entry with unsent grants made grow_running
ask the released sequence for its table; the Scheduler then failed every running request.)
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pytgi_proto.parameters import neutral_sampling
from pytgi_router.core.batch_wire import request_pb
from pytgi_router.core.prefix_cache import PrefixCache
from pytgi_router.core.request import Entry, StoppingParameters, ValidRequest
from pytgi_router.core.request_stream import RequestStream
from pytgi_router.core.step_plan import Budgets, StepPlan, admission_rank, kv_tokens, plan_step
from tests.unit.router.model_shard import next_token

# Which running entries get a token after a step, by bit: mostly all of them (-1), as a
# successful step does; else any subset.
ADVANCED = st.one_of(st.just(-1), st.just(-1), st.integers(0, (1 << 16) - 1))


class StepPlanMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache = PrefixCache(2, 1)
        self.budgets = Budgets(1, 1)
        self.waiting: list[Entry] = []
        self.running: dict[int, Entry] = {}
        self.prefilling: dict[int, Entry] = {}
        self.next_id = 0
        self.next_order = 0
        self.prompts: list[list[int]] = [[0]]

    @initialize(
        num_blocks=st.integers(4, 10),  # a tight pool: growth preempts often
        block_size=st.integers(1, 2),
        caching=st.booleans(),
        prefill_budget=st.integers(1, 12),
        speculate=st.sampled_from([0, 0, 1, 3]),
    )
    def setup(
        self, num_blocks: int, block_size: int, caching: bool, prefill_budget: int,
        speculate: int,
    ) -> None:
        self.cache = PrefixCache(num_blocks, block_size, prefix_caching=caching)
        self.budgets = Budgets(prefill_budget, self.cache.total * block_size, speculate=speculate)

    # Rules

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=4), max_new=st.integers(1, 16),
          again=st.booleans())
    def submit(self, prompt: list[int], max_new: int, again: bool) -> None:
        prompt = self.prompts[len(prompt) % len(self.prompts)] if again else prompt
        max_new = min(max_new, self.cache.total * self.cache.block_size - len(prompt))
        if max_new < 1:
            return
        request = ValidRequest(
            inputs="x", input_ids=prompt, truncate=len(prompt), sampling=neutral_sampling(),
            stopping=StoppingParameters(max_new_tokens=max_new),
        )
        self.waiting.append(Entry(self.next_id, request, RequestStream(),
                                  request_pb(self.next_id, request)))
        self.next_id += 1
        self.prompts.append(prompt)

    @rule(advanced=ADVANCED, kept=st.integers(0, 3))
    def step(self, advanced: int, kept: int) -> None:
        """A step the shards ran: its grants and chunks reached them, and the running entries
        in the mask `advanced` got their next token (all of them, in the Scheduler) after
        `kept` drafts (as many as speculation and their max_new_tokens allow)."""
        self._step(True, advanced, kept)

    @rule(advanced=st.integers(0, (1 << 16) - 1))
    def refused_step(self, advanced: int) -> None:
        """A step the shards refused: its grants stay unsent and its chunks' requests fail;
        the entries in the mask `advanced` get a token anyway (none, in the Scheduler)."""
        self._step(False, advanced)

    # Helpers

    def _step(self, delivered: bool, advanced: int, kept: int = 0) -> None:
        live = [*self.running.values(), *self.prefilling.values()]
        waiting_before = list(self.waiting)
        plan = plan_step(self.cache, self.budgets, self.running.values(),
                         self.prefilling.values(), self.waiting)
        self._check_plan(plan, live, waiting_before)
        self._preempt(plan)
        for entry in plan.newcomers:
            self.waiting.remove(entry)
            if entry.order is None:
                entry.order = self.next_order
                self.next_order += 1
        if not delivered:
            for chunk in plan.chunks:
                self._leave(chunk.entry)
        else:
            for entry, blocks in plan.grants:
                entry.blocks_sent += len(blocks)
            self._write_chunks(plan)
        # A sequence whose prompt completed in this step samples its first token from the
        # prompt's forward: it drafts from its next step on (the shards draft in Decode steps).
        started = {chunk.entry.id for chunk in plan.chunks}
        for bit, entry in enumerate(list(self.running.values())):
            if advanced >> (bit % 16) & 1:
                self._advance(entry, 0 if entry.id in started else kept)

    def _check_plan(self, plan: StepPlan, live: list[Entry], waiting: list[Entry]) -> None:
        gone = {e.id for e in plan.preempted}
        newest = sorted(live, key=admission_rank, reverse=True)[:len(plan.preempted)]
        assert plan.preempted == newest, "victims are the newest live entries, newest first"
        assert not any(e.id in self.cache for e in plan.preempted)
        expected = [(e, self.cache.table(e.id, e.blocks_sent)) for e in self.running.values()
                    if e.id not in gone and e.blocks_held > e.blocks_sent]
        assert sorted(plan.grants, key=lambda g: g[0].id) == sorted(
            expected, key=lambda g: g[0].id)
        for entry in self.running.values():
            if entry.id not in gone:
                assert entry.blocks_held == len(self.cache.table(entry.id))
                assert entry.blocks_held * self.cache.block_size >= kv_tokens(
                    entry, 0, self.budgets.speculate)
        assert plan.newcomers == waiting[:len(plan.newcomers)]
        assert not (plan.preempted and plan.newcomers)

    def _preempt(self, plan: StepPlan) -> None:
        for entry in plan.preempted:  # newest first: each goes in front of the previous
            self.running.pop(entry.id, None)
            self.prefilling.pop(entry.id, None)
            entry.blocks_held = entry.blocks_sent = 0
            entry.computed = 0
            entry.pb.generated_ids[:] = entry.generated
            self.waiting.insert(0, entry)

    def _write_chunks(self, plan: StepPlan) -> None:
        for chunk in plan.chunks:
            entry = chunk.entry
            if chunk.completes:
                self.prefilling.pop(entry.id, None)
                self.running[entry.id] = entry
                entry.blocks_sent = entry.blocks_held
                self._commit(entry, chunk.end)
            else:
                self.prefilling[entry.id] = entry
                self._commit(entry, chunk.end)

    def _advance(self, entry: Entry, kept: int) -> None:
        """The entry's next tokens: `kept` drafts (the most its blocks hold room for and its
        max_new_tokens allows), then the target's token; every one but the last has its KV
        written now (as RunningBatch.apply_step commits), maybe it finished."""
        left = entry.request.stopping.max_new_tokens - len(entry.generated)
        room = entry.blocks_held * self.cache.block_size - len(entry.tokens)
        # The plan left room for every draft the shards may feed (kv_tokens with speculate).
        assert room >= min(kept and self.budgets.speculate, left - 1)
        drafts = max(0, min(kept, self.budgets.speculate, left - 1, room))
        for _ in range(drafts + 1):
            entry.tokens.append(next_token(entry.tokens))
        self._commit(entry, len(entry.tokens) - 1)
        if len(entry.generated) >= entry.request.stopping.max_new_tokens:
            self._leave(entry)

    def _commit(self, entry: Entry, written: int) -> None:
        entry.computed = max(entry.computed, written)
        self.cache.commit(entry.id, entry.tokens[:entry.computed])

    def _leave(self, entry: Entry) -> None:
        self.running.pop(entry.id, None)
        self.prefilling.pop(entry.id, None)
        if entry.id in self.cache:
            self.cache.release(entry.id)

    # Invariants

    @invariant()
    def live_entries_hold_their_tables(self) -> None:
        live = [*self.running.values(), *self.prefilling.values()]
        assert {e.id for e in live} == set(self.cache.snapshot().tables)
        for entry in live:
            assert entry.blocks_sent <= entry.blocks_held == len(self.cache.table(entry.id))


TestStepPlanMachine = StepPlanMachine.TestCase
TestStepPlanMachine.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)

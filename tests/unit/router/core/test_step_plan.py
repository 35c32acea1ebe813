"""The batching task's decisions (step_plan, pure functions over a PrefixCache and entries):
growth and its grants, preemption newest first, the chunk budget, FIFO admission of newcomers
with their cached prefix, the free-block watermark."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pytgi_proto.parameters import neutral_sampling
from pytgi_router.core.batch_wire import request_pb
from pytgi_router.core.prefix_cache import PrefixCache
from pytgi_router.core.request import Entry, StoppingParameters, ValidRequest
from pytgi_router.core.request_stream import RequestStream
from pytgi_router.core.step_plan import (
    Budgets,
    Chunk,
    admission_open,
    admit_newcomers,
    concat_reason,
    continue_prefills,
    grow_running,
    kv_tokens,
    plan_step,
    watermark,
)

BS = 4


def make_entry(entry_id: int, prompt: int | list[int], new_tokens: int = 50,
               prefill_logprobs: bool = False) -> Entry:
    ids = list(range(1, prompt + 1)) if isinstance(prompt, int) else prompt
    request = ValidRequest(
        inputs="x", input_ids=ids, truncate=len(ids), sampling=neutral_sampling(),
        stopping=StoppingParameters(max_new_tokens=new_tokens),
        prefill_logprobs=prefill_logprobs,
    )
    return Entry(entry_id, request, RequestStream(), request_pb(entry_id, request))


def running(cache: PrefixCache, entry: Entry, order: int, generated: int = 1) -> Entry:
    """`entry` admitted as the scheduler does, its prompt computed and `generated` tokens
    sampled (the shards know its whole table)."""
    chunks, _ = admit_newcomers(cache, [entry], 10**6, None, 0)
    assert chunks, "does not fit"
    entry.order = order
    entry.tokens.extend(range(900, 900 + generated))
    entry.computed = len(entry.tokens) - 1
    entry.blocks_sent = entry.blocks_held
    return entry


def prefilling(cache: PrefixCache, entry: Entry, order: int, computed: int) -> Entry:
    chunks, _ = admit_newcomers(cache, [entry], 10**6, None, 0)
    assert chunks
    entry.order = order
    entry.computed = computed
    return entry


def test_kv_tokens_is_known_plus_one_but_never_past_the_last_position() -> None:
    entry = make_entry(0, 5, new_tokens=3)
    assert kv_tokens(entry) == 6 and kv_tokens(entry, 1) == 7
    entry.tokens.extend([7, 8])  # 2 of 3 generated: the last step feeds position 6
    assert kv_tokens(entry) == 7
    assert kv_tokens(make_entry(1, 5, new_tokens=1)) == 5


def test_speculation_holds_the_drafts_slots_up_to_the_last_position() -> None:
    entry = make_entry(0, 5, new_tokens=10)
    assert kv_tokens(entry, 0, 4) == 10  # 5 known + 1 + 4 drafts
    entry.tokens.extend([7] * 7)  # 12 known, 3 left: at most 2 drafts, positions up to 13
    assert kv_tokens(entry, 0, 4) == 14 == entry.total_tokens - 1


def test_growth_with_speculation_covers_every_draft_slot() -> None:
    cache = PrefixCache(101, BS)
    entry = running(cache, make_entry(0, 6, new_tokens=40), order=0, generated=1)  # 7 known
    assert grow_running(cache, [entry]).grants == []  # 8 slots: enough without drafts
    ((granted, blocks),) = grow_running(cache, [entry], speculate=5).grants
    assert entry.blocks_held * BS >= 7 + 1 + 5 and granted is entry and blocks


def test_admission_takes_the_prompt_plus_one_never_max_new_tokens() -> None:
    cache = PrefixCache(101, BS)
    (chunk,), _ = admit_newcomers(cache, [make_entry(0, 8, new_tokens=1000)], 100, None, 0)
    assert cache.used_count == 3 and chunk.entry.blocks_held == 3  # 9 tokens in blocks of 4
    assert (chunk.cache_len, chunk.length, chunk.completes) == (0, 8, True)


def test_a_newcomer_starts_after_its_cached_prefix_unless_it_wants_prompt_logprobs() -> None:
    cache = PrefixCache(101, BS)
    first = running(cache, make_entry(0, list(range(10, 20))), order=0)
    cache.commit(0, first.tokens[:first.computed])
    (chunk,), _ = admit_newcomers(cache, [make_entry(1, list(range(10, 19)) + [77])], 100, None, 0)
    assert (chunk.cache_len, chunk.length) == (8, 2)  # two whole blocks hit, never the last's
    assert chunk.entry.computed == 8
    logprobs = make_entry(2, list(range(10, 20)), prefill_logprobs=True)
    (chunk,), _ = admit_newcomers(cache, [logprobs], 100, None, 0)
    assert (chunk.cache_len, chunk.length) == (0, 10)
    assert not set(cache.table(2)) & set(cache.table(0)), "its own blocks, none shared"


def test_the_budget_goes_to_continuing_prefills_oldest_first_then_newcomers() -> None:
    cache = PrefixCache(101, BS)
    young = prefilling(cache, make_entry(0, 10), order=5, computed=4)
    old = prefilling(cache, make_entry(1, 12), order=2, computed=9)
    chunks = continue_prefills([young, old], budget=8)
    assert [(c.entry.id, c.cache_len, c.length, c.completes) for c in chunks] == [
        (1, 9, 3, True), (0, 4, 5, False)]
    budgets = Budgets(max_batch_prefill_tokens=10, max_batch_total_tokens=400)
    plan = plan_step(cache, budgets, [], [young, old], [make_entry(2, 7), make_entry(3, 2)])
    assert [(c.entry.id, c.cache_len, c.length) for c in plan.chunks] == [
        (1, 9, 3), (0, 4, 6), (2, 0, 1)]
    assert plan.newcomers == [plan.chunks[2].entry], "the budget ends inside the newcomer"


def test_admission_is_fifo_and_bounded_by_blocks_slots_and_budget() -> None:
    cache = PrefixCache(7, BS)  # 6 blocks
    # 7 + 1 slots in 2 blocks, 11 + 1 in 3, 2 in 1 (none crosses a block in its next step).
    waiting = [make_entry(0, 6), make_entry(1, 10), make_entry(2, 1)]
    chunks, _ = admit_newcomers(cache, waiting, 100, None, 0)
    assert [c.entry.id for c in chunks] == [0, 1, 2] and cache.free_count == 0
    cache = PrefixCache(7, BS)
    chunks, _ = admit_newcomers(cache, [make_entry(0, 7), make_entry(1, 20), make_entry(2, 1)],
                                100, None, 0)
    assert [c.entry.id for c in chunks] == [0], "the head that does not fit blocks the rest"
    chunks, _ = admit_newcomers(PrefixCache(101, BS), waiting[:0] + [make_entry(5, 3),
                                make_entry(6, 3)], 100, 1, 0)
    assert len(chunks) == 1
    chunks, _ = admit_newcomers(PrefixCache(101, BS), [make_entry(7, 3)], 0, None, 0)
    assert chunks == []


def test_without_chunking_a_prompt_waits_for_a_budget_that_holds_it_whole() -> None:
    cache = PrefixCache(101, BS)
    chunks, _ = admit_newcomers(cache, [make_entry(0, 6), make_entry(1, 6)], 10, None, 0,
                                chunking=False)
    assert [(c.entry.id, c.length) for c in chunks] == [(0, 6)]
    chunks, _ = admit_newcomers(cache, [make_entry(1, 6)], 10, None, 0, chunking=True)
    assert [(c.length, c.completes) for c in chunks] == [(6, True)]


def test_without_chunking_a_resumed_sequence_past_the_budget_goes_alone() -> None:
    """A preempted request resumes with its generated tokens (an encoder-decoder's shards do not
    chunk): past the budget, it is admitted whole when it comes first instead of blocking the
    queue forever, and nothing joins it."""
    resumed = make_entry(0, 8, new_tokens=20)
    resumed.tokens.extend(range(900, 905))  # 13 tokens, the budget 10
    chunks, _ = admit_newcomers(PrefixCache(101, BS), [resumed, make_entry(1, 2)], 10, None, 0,
                                chunking=False)
    assert [(c.entry.id, c.cache_len, c.length, c.completes) for c in chunks] == [(0, 0, 13, True)]


def test_cancelled_entries_are_skipped_and_reported() -> None:
    gone = make_entry(0, 3)
    gone.stream.cancel()
    chunks, cancelled = admit_newcomers(PrefixCache(101, BS), [gone, make_entry(1, 3)], 100,
                                        None, 0)
    assert [c.entry.id for c in chunks] == [1] and cancelled == [gone]


def test_growth_grants_only_the_new_tail_of_the_table() -> None:
    cache = PrefixCache(101, BS)
    entry = running(cache, make_entry(0, 6), order=0, generated=1)  # 7 known, holds 2 blocks
    assert entry.blocks_held == 2
    growth = grow_running(cache, [entry])
    assert growth.grants == [] and growth.preempted == []  # 8 slots for 7 + 1
    entry.tokens.append(5)  # 8 known: the step needs 9 slots
    growth = grow_running(cache, [entry])
    ((granted, blocks),) = growth.grants
    assert granted is entry and blocks == cache.table(0)[2:] and len(blocks) == 1
    assert entry.blocks_held == 3 and entry.blocks_sent == 2
    # Not sent (the step failed or was refused): the same tail is granted again.
    assert grow_running(cache, [entry]).grants == [(entry, blocks)]


def test_a_short_pool_preempts_the_newest_first_and_grows_the_others() -> None:
    cache = PrefixCache(7, BS)  # 6 blocks
    old = running(cache, make_entry(0, 6), order=0, generated=2)  # 8 known: needs 9 -> 3 blocks
    mid = prefilling(cache, make_entry(1, 4), order=1, computed=0)  # 2 blocks
    new = running(cache, make_entry(2, 4), order=2, generated=1)  # 5 known, 6 -> 2 blocks
    assert cache.free_count == 0
    growth = grow_running(cache, [new, old], [mid])
    assert growth.preempted == [new]
    assert [(e.id, len(b)) for e, b in growth.grants] == [(0, 1)]
    assert 2 not in cache and 1 in cache and old.blocks_held == 3
    assert watermark([old], [], BS) == 0  # old holds 12 slots, needs 10 next step
    old.tokens.extend([1, 2, 3])  # 11 known: the next step needs 13 slots
    assert watermark([old], [], BS) == 1 and watermark([old], [Chunk.of(new, 0, 5)], BS) == 1
    crossing, not_crossing = make_entry(9, 7), make_entry(10, 6)
    crossing.blocks_held = not_crossing.blocks_held = 2  # a prompt completing: 9 / 8 slots next
    chunks = [Chunk.of(crossing, 3, 4), Chunk.of(not_crossing, 0, 6), Chunk.of(crossing, 0, 3)]
    assert watermark([old], chunks, BS) == 2


def test_a_sequence_mid_prefill_is_a_victim_too_when_it_is_the_newest() -> None:
    cache = PrefixCache(7, BS)
    old = running(cache, make_entry(0, 6), order=0, generated=2)
    other = running(cache, make_entry(2, 4), order=1, generated=1)
    young = prefilling(cache, make_entry(1, 4), order=2, computed=4)
    growth = grow_running(cache, [old, other], [young])
    assert growth.preempted == [young] and 1 not in cache
    budgets = Budgets(max_batch_prefill_tokens=100, max_batch_total_tokens=24)
    assert continue_prefills([], 10) == []
    assert plan_step(cache, budgets, [old, other], [], []).preempted == []


def test_the_growing_entry_itself_is_preempted_when_it_is_the_newest() -> None:
    cache = PrefixCache(5, BS)  # 4 blocks
    old = running(cache, make_entry(0, 6), order=0, generated=1)  # 7 known, 8 slots
    new = running(cache, make_entry(1, 6), order=1, generated=2)  # 8 known: needs a 3rd block
    growth = grow_running(cache, [old, new])
    assert growth.preempted == [new] and growth.grants == []
    assert old.blocks_held == 2 and cache.free_count == 2


def test_a_step_that_preempts_admits_nobody() -> None:
    cache = PrefixCache(5, BS)
    old = running(cache, make_entry(0, 6), order=0, generated=1)
    new = running(cache, make_entry(1, 6), order=1, generated=2)
    budgets = Budgets(max_batch_prefill_tokens=100, max_batch_total_tokens=16)
    plan = plan_step(cache, budgets, [old, new], [], [make_entry(2, 1)])
    assert plan.preempted == [new] and plan.newcomers == [] and plan.chunks == []


def test_the_watermark_keeps_a_block_for_each_sequence_about_to_cross() -> None:
    cache = PrefixCache(6, BS)  # 5 blocks
    entry = running(cache, make_entry(0, 6), order=0, generated=1)  # 7 known: 8 slots, full
    budgets = Budgets(max_batch_prefill_tokens=100, max_batch_total_tokens=20)
    plan = plan_step(cache, budgets, [entry], [], [make_entry(1, 7)])  # needs 2 of 3 free
    assert plan.grants == [] and [c.entry.id for c in plan.chunks] == [1]
    cache = PrefixCache(6, BS)
    entry = running(cache, make_entry(0, 6), order=0, generated=1)
    plan = plan_step(cache, budgets, [entry], [], [make_entry(1, 11)])  # 3 of 3, none left
    assert plan.chunks == [], "the running sequence's next block must stay free"


def test_max_batch_size_counts_running_and_prefilling_entries() -> None:
    cache = PrefixCache(101, BS)
    a = running(cache, make_entry(0, 3), order=0)
    b = prefilling(cache, make_entry(1, 30), order=1, computed=4)
    budgets = Budgets(100, 400, max_batch_size=3)
    plan = plan_step(cache, budgets, [a], [b], [make_entry(2, 3), make_entry(3, 3)])
    assert [e.id for e in plan.newcomers] == [2]


def test_without_chunking_newcomers_wait_for_enough_company_or_long_enough() -> None:
    plain = Budgets(512, 4096, waiting_served_ratio=0.3, max_waiting_tokens=20, chunking=False)
    assert admission_open(plain, running=0, waiting=1, steps_since_admission=0)
    assert not admission_open(plain, running=16, waiting=3, steps_since_admission=5)
    assert admission_open(plain, running=16, waiting=4, steps_since_admission=5)
    assert admission_open(plain, running=16, waiting=1, steps_since_admission=20)
    assert concat_reason(plain, 20) == "wait_exceeded" and concat_reason(plain, 3) == "backpressure"
    chunking = Budgets(512, 4096)
    assert admission_open(chunking, running=100, waiting=1, steps_since_admission=0)
    assert concat_reason(chunking, 100) == "backpressure"


def test_chunk_completes_as_planned() -> None:
    entry = make_entry(0, 5)
    chunk = Chunk.of(entry, 2, 3)
    entry.tokens.append(9)  # the step appended its token: the plan still says it completed
    assert chunk.completes and chunk.end == 5
    assert not Chunk.of(entry, 0, 3).completes


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 30)), min_size=1, max_size=12),
    num_blocks=st.integers(2, 40),
    budget=st.integers(1, 80),
    slots=st.none() | st.integers(0, 6),
    watermark=st.integers(0, 3),
    chunking=st.booleans(),
)
def test_admission_never_exceeds_a_budget(
    sizes: list[tuple[int, int]], num_blocks: int, budget: int, slots: int | None,
    watermark: int, chunking: bool,
) -> None:
    cache = PrefixCache(num_blocks, BS)
    waiting = [make_entry(i, prompt, new) for i, (prompt, new) in enumerate(sizes)]
    chunks, _ = admit_newcomers(cache, waiting, budget, slots, watermark, chunking)
    assert [c.entry.id for c in chunks] == list(range(len(chunks))), "a FIFO prefix"
    assert sum(c.length for c in chunks) <= budget
    assert all(c.length >= 1 for c in chunks)
    assert slots is None or len(chunks) <= slots
    if chunks:
        # Only the last admission may have used up the watermark's blocks... never: it keeps
        # them free (each completing newcomer that will cross raises it by one).
        assert cache.free_count >= watermark
    assert cache.used_count == sum(c.entry.blocks_held for c in chunks)
    for chunk in chunks:
        entry = chunk.entry
        assert entry.blocks_held * BS >= kv_tokens(entry)
        assert chunk.completes == (chunk.length == len(entry.tokens))
        assert chunking or chunk.completes


def test_a_victim_met_later_in_the_loop_with_unsent_grants_is_skipped() -> None:
    """A refused step (Scheduler._refuse) leaves its grants unsent, to go out with the next
    one. When an older entry's growth preempts such an entry before the loop reaches it, its
    blocks are gone: it must be skipped, not asked for its table (which raised, and the
    scheduler then failed every running request)."""
    cache = PrefixCache(7, BS)  # 6 blocks
    old = running(cache, make_entry(0, 6), order=0, generated=1)  # 7 known, 2 blocks
    new = running(cache, make_entry(2, 6), order=2, generated=2)  # 8 known: grows to 3
    ((granted, _),) = grow_running(cache, [old, new]).grants
    assert granted is new and (new.blocks_held, new.blocks_sent) == (3, 2)  # refused: unsent
    mid = prefilling(cache, make_entry(1, 3), order=1, computed=0)  # the last free block
    old.tokens.append(5)  # 8 known: old needs a 3rd block, and none is free
    assert cache.free_count == 0
    growth = grow_running(cache, [old, new], [mid])
    assert growth.preempted == [new] and 2 not in cache and 1 in cache
    assert [(e.id, b) for e, b in growth.grants] == [(0, cache.table(0)[2:])]
    assert old.blocks_held == 3

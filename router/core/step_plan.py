"""What one step of the batching task computes, decided without I/O: pure policy over the KV
blocks (PrefixCache) and the live entries, unit-tested without shards.

Every step, in this order:

1. Growth. KV is allocated on demand: before a step each running sequence's blocks must hold its
   known tokens plus one (the token this step computes, and the one the shards' look-ahead
   writes after sampling). New blocks go to the shards as BlockGrants with the step. When the
   pool cannot supply them, the most recently admitted live sequences (running or mid-prefill)
   are preempted, newest first, until it can: the oldest requests always progress, so a tight
   pool degrades into taking turns, never into a livelock. A preempted sequence keeps the rank
   of its first admission, so the request that just resumed is not the next victim by default.
2. Chunks. `max_batch_prefill_tokens` bounds the prompt tokens computed per step; the running
   sequences' decode rows ride along uncounted. Sequences mid-prefill continue first, oldest
   first; then newcomers leave the head of the FIFO queue while the budget, the blocks and
   `max_batch_size` allow (nobody overtakes the head). A newcomer takes blocks for its sequence
   plus one token, minus its cached prefix; never for its max_new_tokens.
3. Watermark. A newcomer is admitted only if the pool keeps one free block for every live
   sequence that crosses a block boundary in the next step (running ones, and those whose
   prompt completes in this one). That is exactly what the next growth takes, so an admission
   never forces a preemption one step later; a fixed share of the pool would be too little for
   a large batch of short blocks and idle memory for a small one.

Speculation (the shards' --speculate N): a decode step may also feed up to N drafted tokens per
running sequence after its last one, each writing KV at the next positions; so growth holds N
more slots per running sequence (never past the last position it can ever feed: the shards draft
at most max_new_tokens - generated - 1). The router never learns which drafts were written: a
step's Generation carries the tokens kept, the sequence advances by those (apply_step), and the
slots of rejected drafts are simply overwritten by later steps. Only blocks full of kept tokens
are committed to the prefix cache (apply_step commits up to the KV computed, which never counts
a draft). Drafts ride in decode steps only (a step with prompt chunks carries none), so the
prefill budget is untouched.

A step that had to preempt admits nobody: the pool is short, and the victims (now at the head of
the queue) would be re-admitted at once only to be preempted again.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

from pytgi_proto import contracts as c
from pytgi_router.core.adapter_cap import fits_adapter_cap, live_adapters
from pytgi_router.core.capacity import ShardInfo
from pytgi_router.core.infer_settings import InferSettings
from pytgi_router.core.prefix_cache import PrefixCache
from pytgi_router.core.request import Entry


@dataclass(frozen=True, slots=True)
class Budgets:
    """The scheduler's limits, fixed at startup from the settings and the shards' Warmup."""

    max_batch_prefill_tokens: int
    max_batch_total_tokens: int
    max_batch_size: int | None = None
    # Only for shards without chunking (a prefill then pauses the running batch).
    waiting_served_ratio: float = c.WAITING_SERVED_RATIO
    max_waiting_tokens: int = c.MAX_WAITING_TOKENS
    # The shards split prompts into chunks and mix them with the running batch's decode rows.
    chunking: bool = True
    # Draft tokens a running sequence may feed per decode step (the shards' --speculate).
    speculate: int = 0
    # Distinct LoRA adapters one step may carry (the shards' --max-loras; 0: no adapters).
    max_loras: int = 0
    # Decode steps one Decode call may run when nothing waits (router/core/decode_steps.py).
    max_decode_steps: int = 1
    # The longest such a call is planned to run, in ms (0: no bound).
    max_decode_call_ms: int = 0

    @classmethod
    def of(cls, settings: InferSettings, served: ShardInfo) -> Budgets:
        """The budgets for the limits served (the KV and prefill budgets as the shards' Warmup
        fixed them) under the settings' batching knobs."""
        return cls(
            max_batch_prefill_tokens=served.max_batch_prefill_tokens,
            max_batch_total_tokens=served.max_batch_total_tokens,
            max_batch_size=settings.max_batch_size,
            waiting_served_ratio=settings.waiting_served_ratio,
            max_waiting_tokens=settings.max_waiting_tokens,
            chunking=served.support_chunking,
            speculate=served.speculate,
            max_loras=served.max_loras,
            max_decode_steps=settings.max_decode_steps,
            max_decode_call_ms=settings.max_decode_call_ms,
        )


@dataclass(frozen=True, slots=True)
class Chunk:
    """Tokens [cache_len, cache_len + length) of an entry's sequence, computed in one step.
    `completes`: the chunk reaches the sequence's end (as planned: the step then appends a
    token), so the shards sample its next token and keep it in their batch; otherwise they only
    write its KV and forget it."""

    entry: Entry
    cache_len: int
    length: int
    completes: bool

    @classmethod
    def of(cls, entry: Entry, cache_len: int, length: int) -> Chunk:
        return cls(entry, cache_len, length, cache_len + length == len(entry.tokens))

    @property
    def end(self) -> int:
        return self.cache_len + self.length


@dataclass(slots=True)
class Growth:
    # New blocks of running entries (their tables' tails the shards do not know yet).
    grants: list[tuple[Entry, tuple[int, ...]]] = field(default_factory=list)
    # Preempted entries, newest first; their blocks are already released.
    preempted: list[Entry] = field(default_factory=list)


@dataclass(slots=True)
class StepPlan:
    grants: list[tuple[Entry, tuple[int, ...]]]
    preempted: list[Entry]
    # Continuing prefills first (oldest first), then the newcomers' first chunks.
    chunks: list[Chunk]
    # Entries admitted from the queue in this step (each has a chunk).
    newcomers: list[Entry]
    # Cancelled entries met at the head of the queue (to drop).
    cancelled: list[Entry]


def kv_tokens(entry: Entry, ahead: int = 0, speculate: int = 0) -> int:
    """KV slots the entry's blocks must hold before its next step (`ahead` steps later): its
    known tokens plus one, plus `speculate` drafts' slots, but never beyond the last position
    it can ever feed (prompt + max_new_tokens - 1; the shards ask for no more)."""
    return min(len(entry.tokens) + 1 + ahead + speculate, entry.total_tokens - 1)


def admission_rank(entry: Entry) -> int:
    assert entry.order is not None, f"entry {entry.id} is live but was never admitted"
    return entry.order


def crosses_next_step(entry: Entry, block_size: int, speculate: int = 0) -> bool:
    """Whether the entry's next step (after the one being planned) needs one more block."""
    return kv_tokens(entry, 1, speculate) > entry.blocks_held * block_size


def grow_running(
    cache: PrefixCache,
    running: Collection[Entry],
    prefilling: Collection[Entry] = (),
    speculate: int = 0,
) -> Growth:
    """Grows every running entry to `kv_tokens` (with `speculate` drafts' slots); while the
    pool is short, preempts the newest live entry (running or prefilling). Updates each entry's
    `blocks_held`. O(running), and the common entry (its blocks hold the step) costs a few
    integer operations."""
    size = cache.block_size
    growth = Growth()
    gone: set[int] = set()
    by_age: list[Entry] | None = None
    for entry in running:
        # A victim of an earlier entry's growth: its blocks are gone, even those a refused
        # step left unsent (Scheduler._refuse).
        if gone and entry.id in gone:
            continue
        known = len(entry.tokens) + speculate
        if known < entry.blocks_held * size:  # holds known + 1: kv_tokens at most
            if entry.blocks_held > entry.blocks_sent:
                growth.grants.append((entry, cache.table(entry.id, entry.blocks_sent)))
            continue
        need = kv_tokens(entry, 0, speculate)
        if need > entry.blocks_held * size:
            while not cache.grow(entry.id, need):
                if by_age is None:
                    by_age = sorted([*running, *prefilling], key=admission_rank)
                victim = by_age.pop()
                cache.release(victim.id)
                growth.preempted.append(victim)
                gone.add(victim.id)
                if victim is entry:
                    break
            if entry.id in gone:
                continue
            entry.blocks_held = cache.blocks_for(need)
        if entry.blocks_held > entry.blocks_sent:
            growth.grants.append((entry, cache.table(entry.id, entry.blocks_sent)))
    if gone:
        growth.grants = [g for g in growth.grants if g[0].id not in gone]
    return growth


def watermark(
    running: Iterable[Entry], chunks: Iterable[Chunk], block_size: int, speculate: int = 0
) -> int:
    """Blocks the next step's growth takes: per running entry, and per entry whose prompt
    completes in this step, the blocks it needs then beyond those it holds (one at most without
    speculation; a sequence that drafts may cross more than one boundary)."""
    return sum(_next_blocks(e, block_size, speculate) for e in running) + sum(
        _next_blocks(chunk.entry, block_size, speculate) for chunk in chunks if chunk.completes
    )


def _next_blocks(entry: Entry, block_size: int, speculate: int) -> int:
    """Blocks the entry's next growth (after the step being planned) adds to those it holds."""
    if not crosses_next_step(entry, block_size, speculate):
        return 0
    need = -(-kv_tokens(entry, 1, speculate) // block_size)
    return need - entry.blocks_held


def span_safe_length(spans: Sequence[tuple[int, int]], start: int, length: int) -> int:
    """A chunk's length from `start` with its end moved out of any bidirectional span [lo, hi)
    it would fall inside (a model attending within the span needs all of it in one forward):
    back to the span's start when the chunk has tokens before it, else on to the span's end
    (past the budget: a span longer than the budget is computed whole, or never)."""
    end = start + length
    for lo, hi in spans:
        if lo < end < hi:
            end = lo if lo > start else hi
    return end - start


def continue_prefills(prefilling: Iterable[Entry], budget: int) -> list[Chunk]:
    """The next chunk of each sequence mid-prefill, oldest first, within `budget` tokens (a
    chunk that would end inside a bidirectional span ends before it, or after it)."""
    chunks: list[Chunk] = []
    for entry in sorted(prefilling, key=admission_rank):
        if budget <= 0:
            break
        length = min(len(entry.tokens) - entry.computed, budget)
        length = span_safe_length(entry.request.noncausal_spans, entry.computed, length)
        chunks.append(Chunk.of(entry, entry.computed, length))
        budget -= length
    return chunks


def admit_newcomers(
    cache: PrefixCache,
    waiting: Iterable[Entry],
    budget: int,
    slots: int | None,
    watermark: int,
    chunking: bool = True,
    speculate: int = 0,
    adapters: set[int] | None = None,
    max_loras: int = 0,
) -> tuple[list[Chunk], list[Entry]]:
    """(first chunks of the entries admitted from the head of `waiting`, cancelled entries met
    on the way). Admission stops at the first entry that does not fit: `budget` prompt tokens
    left, `slots` more live entries (None: no bound), blocks beyond `watermark` free ones.
    Without `chunking` a newcomer's whole uncached sequence must fit the budget, except a
    preempted request's that comes first: it resumes with its generated tokens, which may take
    it past the budget, and would otherwise wait at the head of the queue forever.
    `adapters`: the LoRA adapters of the live entries, which the admitted add to; a newcomer
    whose adapter would make them more than `max_loras` (0: no cap) waits (adapter_cap.py).

    A request that wants prompt logprobs takes no cached prefix (it must compute every token);
    the others take the longest one cached. Sets each admitted entry's blocks and `computed`.
    """
    size = cache.block_size
    chunks: list[Chunk] = []
    cancelled: list[Entry] = []
    for entry in waiting:
        if entry.stream.cancelled:
            cancelled.append(entry)
            continue
        if budget <= 0 or (slots is not None and len(chunks) >= slots):
            break
        tokens = entry.key_tokens
        reuse = not entry.pb.prefill_logprobs
        adapter = entry.request.adapter_key
        if not fits_adapter_cap(adapters, entry.request.adapter_index, max_loras):
            break
        reserve = kv_tokens(entry) - len(tokens)
        if cache.blocks_needed(tokens, reserve, reuse, adapter) + watermark > cache.free_count:
            break
        if not chunking and len(tokens) - cache.cached_prefix(tokens, reuse, adapter) > budget and (
            chunks or len(tokens) == len(entry.request.input_ids)
        ):
            break
        admission = cache.admit(entry.id, tokens, reserve, reuse, adapter)
        if admission is None:  # blocks_needed said it fits: never, short of a bug
            break
        entry.blocks_held = len(admission.blocks)
        entry.blocks_sent = 0
        entry.computed = admission.cached_tokens
        uncached = len(tokens) - admission.cached_tokens
        length = span_safe_length(entry.request.noncausal_spans, admission.cached_tokens,
                                  min(uncached, budget)) if chunking else uncached
        chunk = Chunk.of(entry, admission.cached_tokens, length)
        budget -= chunk.length
        if chunk.completes:
            watermark += _next_blocks(entry, size, speculate)
        chunks.append(chunk)
        if adapters is not None and entry.request.adapter_index:
            adapters.add(entry.request.adapter_index)
    return chunks, cancelled


def admission_open(
    budgets: Budgets, running: int, waiting: int, steps_since_admission: int
) -> bool:
    """Whether newcomers may join this step. With chunking, always: a mixed step keeps the
    running streams going. Without, a prefill pauses them, so (TGI's rule) only for enough
    newcomers (running x waiting_served_ratio) or after max_waiting_tokens steps."""
    if budgets.chunking or running == 0:
        return True
    if steps_since_admission >= budgets.max_waiting_tokens:
        return True
    return waiting >= int(running * budgets.waiting_served_ratio)


def concat_reason(budgets: Budgets, steps_since_admission: int) -> str:
    """The `reason` label of tgi_batch_concat when newcomers join a running batch."""
    if not budgets.chunking and steps_since_admission >= budgets.max_waiting_tokens:
        return "wait_exceeded"
    return "backpressure"


def plan_step(
    cache: PrefixCache,
    budgets: Budgets,
    running: Collection[Entry],
    prefilling: Collection[Entry],
    waiting: Iterable[Entry],
    admit: bool = True,
) -> StepPlan:
    """The whole step: growth (and preemption), continuing chunks, newcomers (if `admit`)."""
    growth = grow_running(cache, running, prefilling, budgets.speculate)
    gone = {e.id for e in growth.preempted}
    still = [e for e in prefilling if e.id not in gone] if gone else list(prefilling)
    budget = budgets.max_batch_prefill_tokens
    chunks = continue_prefills(still, budget)
    budget -= sum(chunk.length for chunk in chunks)
    newcomers: list[Chunk] = []
    cancelled: list[Entry] = []
    if admit and not growth.preempted and next(iter(waiting), None) is not None:
        slots = None
        if budgets.max_batch_size is not None:
            slots = budgets.max_batch_size - (len(running) + len(still))
        newcomers, cancelled = admit_newcomers(
            cache, waiting, budget, slots,
            watermark(running, chunks, cache.block_size, budgets.speculate),
            budgets.chunking, budgets.speculate,
            live_adapters([*running, *still]), budgets.max_loras,
        )
    return StepPlan(
        grants=growth.grants,
        preempted=growth.preempted,
        chunks=chunks + newcomers,
        newcomers=[chunk.entry for chunk in newcomers],
        cancelled=cancelled,
    )

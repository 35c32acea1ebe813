"""How many decode steps the next Decode call runs (multi-step decode; the shards' side is
shard/engine/multi_step.py): pure policy over the step plan and the live entries, no I/O.

A decode step's time outside the forward (the router's turn: routing the step's tokens, planning
the next; and the gRPC round trip) is paid once per call. On a small model, or any model on a
CPU, it is as large as the forward, so running k steps per call when nothing could change
between them pays it once per k tokens.

Nothing changes between steps when:
- the plan computes no prompt chunk (nobody mid-prefill, no newcomer) and preempted nobody;
- nobody waits to join: the queue is empty, or (shards without chunking) admission is closed,
  for at most the steps it stays closed (`max_waiting_tokens`);
- no live request was cancelled (it would compute k - 1 tokens for nothing);
- nobody drafts (`--speculate`): a verification step advances a row by a variable number of
  tokens, which the blocks granted ahead cannot be sized for;
- every running row's blocks hold the KV of all k steps, so the shards never need a grant mid-
  call. When the pool can spare them, the rows' blocks are grown to cover `max_steps` steps
  (granted with the call); otherwise k is what the blocks already held cover.

How long a call runs matters too: a stream's tokens reach the router only at the call's end
(its bursts), and a request cancelled mid-call computes to the end. So k is also bounded by
time (`steps_in_time`): as many steps as `max_decode_call_ms` holds at the last call's time per
step, scaled up by the rows the batch gained since; one step until a call was timed. A small
model's fast steps then run many per call (the round trip is most of their cost) and a large
model's slow ones few (the round trip is noise beside them).

Everything else the router does per token (stop sequences, grammars, max_new_tokens and EOS are
decided in the shards; the router only routes the Generations) works the same across a call:
a row that finishes mid-call leaves the shards' batch as in any step and its later steps carry
it no more, so k is not capped by the tokens a row has left. A queue holding anybody at
planning time keeps k = 1. A request arriving during a call would wait for its end (TTFT up by
k - 1 steps), so the router cuts the call short (`cut_short_wanted`, the CutShort RPC): the
shards stop after the step they are on and the next call prefills the newcomer.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from pytgi_router.core.prefix_cache import PrefixCache
from pytgi_router.core.request import Entry
from pytgi_router.core.step_plan import Budgets, StepPlan, admission_open, kv_tokens


def steps_wanted(
    budgets: Budgets,
    plan: StepPlan,
    prefilling: int,
    waiting: int,
    admit: bool,
    steps_since_admission: int,
    cancelling: bool,
) -> int:
    """The steps the call may run before the blocks are considered: 1 unless nothing can join,
    leave or change mid-call (see the module's list); then `max_decode_steps`, or fewer when
    admission (closed, shards without chunking) opens again sooner."""
    most = budgets.max_decode_steps
    if most <= 1 or budgets.speculate or plan.chunks or plan.preempted or prefilling or cancelling:
        return 1
    if waiting:
        if admit:
            return 1
        # Closed only until max_waiting_tokens steps passed since the last admission.
        most = min(most, budgets.max_waiting_tokens - steps_since_admission)
    return max(most, 1)


@dataclass(frozen=True, slots=True)
class StepTime:
    """A timed Decode call's wall time per step (the round trip included) over its rows."""

    seconds: float
    rows: int


def steps_in_time(most: int, call_ms: int, last: StepTime | None, rows: int) -> int:
    """Of `most` steps, as many as a call of `call_ms` holds at `last`'s time per step, scaled
    by the rows added since (a step's time grows at most in proportion to its rows); 1 until a
    call was timed (a first call of a slow model must not run `most` steps); `most` when
    `call_ms` is 0 (no bound)."""
    if call_ms <= 0 or most <= 1:
        return most
    if last is None:
        return 1
    per_step = last.seconds * max(1.0, rows / max(last.rows, 1))
    return max(1, min(most, int(call_ms / 1e3 / per_step)))


def cut_short_wanted(
    budgets: Budgets, running: int, waiting: int, steps_since_admission: int
) -> bool:
    """Whether a multi-step call in flight should stop after its current step: someone waits
    and may join (the rule that would have kept k = 1 had they come before the call).
    `steps_since_admission` is the count when the call was planned: for shards without
    chunking (admission opens for a crowd, or after max_waiting_tokens steps), only a crowd
    cuts a call short, not the steps it runs itself (conservative: a prefill there pauses
    every stream)."""
    return waiting > 0 and admission_open(budgets, running, waiting, steps_since_admission)


def covered_steps(entry: Entry, block_size: int, most: int) -> int:
    """Decode steps (at most `most`) the entry's blocks hold: step j needs kv_tokens(entry, j)
    slots, which stop growing at the last position it can ever feed."""
    held = entry.blocks_held * block_size
    if kv_tokens(entry, most - 1) <= held:
        return most
    # kv_tokens(entry, j) = len(tokens) + 1 + j below its cap: the largest j it fits is
    # held - len(tokens) - 1.
    return max(held - len(entry.tokens), 1)


def grow_for_steps(
    cache: PrefixCache, running: Collection[Entry], steps: int
) -> tuple[int, list[tuple[Entry, tuple[int, ...]]] | None]:
    """(k, grants): grows every running entry's blocks to hold `steps` decode steps when the
    pool can spare all of the blocks that takes (evictable cached prefixes count as free, as for
    any growth); then k = `steps` and `grants` every entry's blocks the shards do not have yet
    (the plan's own grants included). When it cannot, nothing is taken, `grants` is None (the
    plan's stand) and k is the fewest steps any entry's blocks hold already."""
    size = cache.block_size
    short: list[tuple[Entry, int]] = []
    extra = 0
    for entry in running:
        need = kv_tokens(entry, steps - 1)
        if need > entry.blocks_held * size:
            short.append((entry, need))
            extra += cache.blocks_for(need) - entry.blocks_held
    if not short:
        return steps, None
    if extra > cache.free_count:
        return min(covered_steps(e, size, steps) for e, _ in short), None
    for entry, need in short:
        grown = cache.grow(entry.id, need)
        assert grown, "free_count said the pool holds every row's growth"
        entry.blocks_held = cache.blocks_for(need)
    grants = [(e, cache.table(e.id, e.blocks_sent)) for e in running if e.blocks_held > e.blocks_sent]
    return steps, grants

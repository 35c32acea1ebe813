"""Which rows of a decode step carry drafts, and how many (--speculate N): the policy every
drafter shares (plan_asks), and the n-gram drafter's proposals (ngram_drafts). The draft model
(--speculator-model) proposes for the same asks (shard/engine/draft_model.py); both speak
shard/engine/drafter.py's Drafter.

Each eligible request keeps its own n-gram index (shard/speculative/ngram.py) in its
RequestState, empty when it joins the shard's batch and caught up from the batch's token history
(its prompt, generated_ids of a resumed request, every token emitted since) whenever a step may
draft (verification.step_drafts): a batch too large to draft pays nothing, not even the prompt's
indexing (~7 us a token here: 28 ms for a 4,000-token prompt). It survives filter and
concatenate with the RequestState.

Eligible: every request's row (greedy or sampling, with penalties, watermark or a grammar), as
verified exactly by shard/engine/verification.py: each drafted position's token is chosen as the
plain step chooses it there (penalties counting the drafts before it, the grammar mask of its
matcher advanced through them, a sampling row's random numbers those of that token's index:
shard/sample/token_draws.py), and the drafts are kept while they equal those choices. Only an
encoder-decoder's requests never draft (engine.speculate is 0 for it).

Adaptive, so that speculation never makes a busy server slower:
- Only a batch of at most DRAFTING_BATCH rows drafts (larger ones take today's plain step, at no
  cost), and a step's forward carries at most STEP_TOKENS tokens (rows + drafts). On this CPU a
  verification step costs ~1.5 plain steps and a batch advances at its slowest row's pace, so
  drafts paid at batch 1 (1.6x on quoting prompts) and 2 (1.3x quoting, 1.06x mixed) and lost
  at 4 to 16 (0.82-0.87x with mixed prompts: a few rows that rarely keep a draft hold the batch
  to their steps while every step pays the verification), bench/experiments/speculative.py.
- A request whose drafts keep missing (MISSES_TO_PAUSE proposals in a row with none kept)
  pauses drafting for a number of steps that doubles on each pause (up to MAX_PAUSE) and resets
  when a draft is kept.
- A sampling row backs off harder (SAMPLING_BACK_OFF: a pause after its first miss, 16 steps
  doubling up to 256, against a greedy row's GREEDY_BACK_OFF: after 2 misses, 4 steps doubling
  up to 64). A sampling row's draft d is kept with probability p(d), the target's (warped)
  probability of d there, so a request that samples keeps n-gram drafts only where the model
  is nearly certain of the quote; elsewhere its proposals are almost all missed (the demo
  model at temperature 0.7: 3 drafts kept in 123 on quoting prompts), each costing a
  verification forward (~1.5 plain steps here). A row that never keeps a draft proposes at
  most 3 times in 96 steps this way, against 10 under the greedy rule.
  Tried and dropped: proposing only after a token the target gave >= 0.5 (or >= 0.8):
  most missed proposals followed tokens of probability >= 0.95, so the latest token's
  probability did not tell the proposals that pay from the others; and a pause after one miss
  with the greedy pauses (4 doubling to 64): 98 drafts instead of 123 there.
- A miss of the index (no earlier occurrence of the sequence's suffix) costs a few dictionary
  lookups and drafts nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pytgi_shard.speculative.ngram import NgramIndex

# A verification forward carries at most this many tokens (each row's last token plus its
# drafts): drafts fill what the batch leaves of it. A bound on the forward's size for larger
# drafting batches (DRAFTING_BATCH x (1 + --speculate) stays below it today).
STEP_TOKENS = 32
# The largest batch that drafts (the module's docstring has the measurements).
DRAFTING_BATCH = 2
# The n-gram lengths a proposal matches on: the longest suffix of 4 down to 2 tokens found
# earlier. One token alone matches too often to pay: on the demo model's greedy outputs a
# 1-token match's first draft was right 72% of the time, a 2..4-token match's 83%, with 2.3
# vs 2.9 tokens kept per proposal (bench/experiments/speculative.py's prompts), and a missed
# verification costs ~1.5 plain steps on this CPU.
MAX_NGRAM = 4
MIN_NGRAM = 2
# A greedy row's back-off: proposals in a row with no draft kept before a request pauses
# drafting; steps of the first pause; each further pause doubles it, up to MAX_PAUSE.
MISSES_TO_PAUSE = 2
FIRST_PAUSE = 4
MAX_PAUSE = 64


@dataclass(frozen=True, slots=True)
class BackOff:
    """When a request whose drafts keep missing pauses drafting, and for how long."""

    # Proposals in a row with none kept before a pause.
    misses: int
    # Steps of the first pause since a draft was last kept; each further pause doubles it.
    first: int
    # The longest pause.
    longest: int

    def pause(self, pauses: int) -> int:
        """Steps of the pause that follows `pauses` others since a draft was last kept."""
        return min(self.first << min(pauses, 30), self.longest)


GREEDY_BACK_OFF = BackOff(MISSES_TO_PAUSE, FIRST_PAUSE, MAX_PAUSE)
# A sampling row's (the module's docstring). Read at each record, so that
# bench/experiments/speculative.py --sampling-back-off can measure others.
SAMPLING_BACK_OFF = BackOff(1, 16, 256)


@dataclass(slots=True)
class DraftState:
    """One drafting request: its n-gram index and its back-off."""

    index: NgramIndex
    # Proposals since the last kept draft.
    misses: int = 0
    # Steps left to skip before the next proposal.
    paused: int = 0
    # Pauses since a draft was last kept (the next one's length: BackOff.pause).
    pauses: int = 0
    # With a draft model (--speculator-model): the sequence's first positions whose KV this
    # request's drafting wrote into the draft model's cache (shard/engine/draft_model.py).
    written: int = 0

    @classmethod
    def start(cls, sequence: Sequence[int]) -> DraftState:
        index = NgramIndex(MAX_NGRAM, MIN_NGRAM)
        index.extend(sequence)
        return cls(index)

    def record(self, drafted: int, kept: int, sampling: bool = False) -> None:
        """A verification's outcome for this request: a miss streak pauses drafting, by the
        back-off of its kind of row (back_off)."""
        if kept:
            self.misses = self.pauses = 0
            return
        rule = back_off(sampling)
        self.misses += 1
        if self.misses >= rule.misses:
            self.paused, self.misses = rule.pause(self.pauses), 0
            self.pauses += 1


def back_off(sampling: bool) -> BackOff:
    """A row's back-off: a sampling row's drafts are kept only where the model is nearly
    certain, so its first miss already says it is not, and it waits longer."""
    return SAMPLING_BACK_OFF if sampling else GREEDY_BACK_OFF


@dataclass(frozen=True, slots=True)
class Drafts:
    """A step's drafts: the rows that carry any, in order, and each row's drafted tokens."""

    rows: list[int]
    tokens: list[list[int]]

    @property
    def count(self) -> int:
        return sum(len(t) for t in self.tokens)


def plan_asks(
    states: Sequence[DraftState | None],
    room: Sequence[int],
    left: Sequence[int],
    speculate: int,
    drafting_batch: int = DRAFTING_BATCH,
) -> list[tuple[int, int]]:
    """What the step asks the drafter for: (row, k) per row with a DraftState (None: the row
    does not draft) that is not paused, k up to `speculate` tokens, at most room[row] (KV slots
    held past its known tokens: each draft writes one) and left[row] - 1 (max_new_tokens must
    hold the drafts and the target's token after them), within the step's STEP_TOKENS (each
    ask reserves its k); none in a batch of more than `drafting_batch` rows. A paused row's
    pause counts down here, once per step that may draft."""
    budget = STEP_TOKENS - len(states)
    if budget <= 0 or len(states) > drafting_batch:
        return []
    asks: list[tuple[int, int]] = []
    for row, state in enumerate(states):
        if state is None:
            continue
        if state.paused:
            state.paused -= 1
            continue
        k = min(speculate, budget, room[row], left[row] - 1)
        if k <= 0:
            continue
        asks.append((row, k))
        budget -= k
        if budget <= 0:
            break
    return asks


def plan_drafts(
    states: Sequence[DraftState | None],
    room: Sequence[int],
    left: Sequence[int],
    speculate: int,
    drafting_batch: int = DRAFTING_BATCH,
) -> Drafts | None:
    """The step's n-gram drafts: plan_asks' rows, each proposed by its index (indexes fed by
    the caller). None when no row drafts."""
    return ngram_drafts(states, plan_asks(states, room, left, speculate, drafting_batch))


def ngram_drafts(
    states: Sequence[DraftState | None], asks: Sequence[tuple[int, int]]
) -> Drafts | None:
    """Each asked row's n-gram proposal (a row whose index has no earlier occurrence of its
    suffix proposes nothing); None when no row proposed anything."""
    rows: list[int] = []
    tokens: list[list[int]] = []
    for row, k in asks:
        state = states[row]
        assert state is not None
        proposal = state.index.propose(k)
        if proposal:
            rows.append(row)
            tokens.append(proposal)
    return Drafts(rows, tokens) if rows else None

"""The prefill budget (--max-batch-prefill-tokens) when no flag sets it: a policy on measurements.

TGI v3 derives the budget from a table of cards' FLOPs and the model's FLOPs per token; a card
missing from the table, a CPU, or a kernel that reaches its peak earlier or later gets a guess
(4,096). Here Warmup measures instead (shard/engine/prefill_ladder.py): it times the prefill step
at a ladder of sizes (256, 512, 1,024, ... tokens) and this module, on plain numbers and without
torch, decides when to stop climbing and which rung to serve with.

Why the smallest rung within TOLERANCE of the peak throughput: a prefill step stalls every running
stream's next token (its chunk and their decode rows share one forward), so past the point where
more tokens per step stop buying throughput, a bigger budget only lengthens those stalls and the
newcomers' time to first token behind a long chunk.

Bounds, each stated in the reason the router logs:
- one step's time (max_step_s): a rung slower than that stalls the streams too long to be chosen;
- activation memory (on CUDA, measured at each rung, plus the prompt-logprob logits a request may
  ask for): the worst-case prefill may take at most `activation_share` of the memory beside the
  weights, the rest being the KV cache's;
- the ladder's ceiling (its top rung, the KV budget, --max-batch-size whole prompts);
- a floor for shards that cannot chunk a prompt: one whole prompt must fit one prefill;
- the measuring's own time (budget_s), so that Warmup stays short.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

GiB = 2**30


@dataclass(frozen=True, slots=True)
class LadderPolicy:
    """The ladder's knobs; the defaults are what Warmup uses."""

    first_rung: int = 256
    top_rung: int = 32_768
    # A rung within this share of the peak throughput counts as the peak.
    tolerance: float = 0.10
    # The longest one prefill step may take and still be chosen.
    max_step_s: float = 0.5
    # Seconds of steady-state measuring (every repeat of every rung) the ladder may spend.
    budget_s: float = 3.0
    # Times each rung runs; its fastest run counts: the first may pay one-time costs, and on a
    # busy host the fastest of three is much nearer the device's speed than one run.
    repeats: int = 3
    # Share of the memory beside the weights that the worst-case prefill's activations may take.
    activation_share: float = 0.25
    # The longest prompt of a ladder batch: rungs are batches of such prompts, so attention's
    # quadratic part stays the same per token as the ladder climbs.
    prompt_tokens: int = 512


@dataclass(frozen=True, slots=True)
class Rung:
    """One measured prefill size: its fastest run (the slowest rank's) and its activation peak."""

    tokens: int
    seconds: float
    # Device bytes the step allocated beyond what it started with; 0 when not measured (CPU).
    peak_bytes: int = 0
    # Wall seconds all its runs took (on a busy host far more than seconds x repeats); 0: not
    # recorded, counted as seconds x repeats.
    spent_s: float = 0.0

    @property
    def throughput(self) -> float:
        """Prompt tokens per second of this rung."""
        return self.tokens / self.seconds if self.seconds > 0 else math.inf


@dataclass(frozen=True, slots=True)
class Bounds:
    """What bounds the budget besides the measured times."""

    # The largest prefill the ladder may try, and why.
    ceiling: int
    ceiling_why: str
    # Bytes the worst-case prefill's activations may take; 0: not bounded by measurement (CPU).
    activation_bytes: int = 0
    # Extra bytes a prompt token costs when its request asks for prompt logprobs (logits).
    logits_bytes_per_token: int = 0
    # The budget must hold at least this many tokens (a shard that cannot chunk: one prompt).
    floor: int = 0
    floor_why: str = ""


@dataclass(frozen=True, slots=True)
class LadderStep:
    """The ladder's next rung, or None and why it stopped."""

    tokens: int | None
    why: str = ""


@dataclass(frozen=True, slots=True)
class PrefillChoice:
    tokens: int
    why: str


def memory_bound(rungs: Sequence[Rung], bounds: Bounds) -> int | None:
    """The most prefill tokens whose worst-case activations fit `bounds.activation_bytes`, from
    the per-token peak of the largest rung measured (where fixed costs, library workspaces,
    weigh least); None when memory was not measured."""
    measured = [r for r in rungs if r.peak_bytes > 0]
    if bounds.activation_bytes <= 0 or not measured:
        return None
    largest = max(measured, key=lambda r: r.tokens)
    per_token = largest.peak_bytes / largest.tokens + bounds.logits_bytes_per_token
    return max(int(bounds.activation_bytes // per_token), 1)


def _saturated(rungs: Sequence[Rung], tolerance: float) -> bool:
    """Throughput rose by less than `tolerance` over the best before the last two rungs."""
    if len(rungs) < 3:
        return False
    best_before = max(r.throughput for r in rungs[:-2])
    return all(r.throughput < (1 + tolerance) * best_before for r in rungs[-2:])


def _limit(rungs: Sequence[Rung], bounds: Bounds) -> tuple[int, str]:
    """The largest rung allowed now (the ceiling, or the measured memory bound below it)."""
    memory = memory_bound(rungs, bounds)
    if memory is not None and memory < bounds.ceiling:
        return memory, f"activation memory bounds it at {memory} tokens"
    return bounds.ceiling, bounds.ceiling_why


def spent(rungs: Sequence[Rung], policy: LadderPolicy) -> float:
    """Wall seconds the ladder has taken, but for the first rung's one-time costs (a kernel's
    first compilation, which Warmup pays anyway): that rung counts at its fastest run."""
    first = [rungs[0].seconds * policy.repeats] if rungs else []
    return sum(first + [r.spent_s or r.seconds * policy.repeats for r in rungs[1:]])


def next_rung(rungs: Sequence[Rung], bounds: Bounds, policy: LadderPolicy) -> LadderStep:
    """The next size to measure (double the last), or why the ladder stops there."""
    if not rungs:
        return LadderStep(max(min(policy.first_rung, bounds.ceiling), 1))
    last = rungs[-1]
    if last.seconds > policy.max_step_s:
        return LadderStep(None, f"a step of {last.tokens} took {last.seconds:.3g} s "
                                f"(> {policy.max_step_s:g} s)")
    if _saturated(rungs, policy.tolerance):
        return LadderStep(None, f"throughput rose < {policy.tolerance:.0%} over the last two "
                                f"doublings")
    limit, limit_why = _limit(rungs, bounds)
    if last.tokens >= limit:
        return LadderStep(None, limit_why)
    tokens = min(last.tokens * 2, limit)
    predicted = last.seconds * tokens / last.tokens
    if predicted > policy.max_step_s:
        return LadderStep(None, f"a step of {tokens} would take ~{predicted:.3g} s "
                                f"(> {policy.max_step_s:g} s)")
    if spent(rungs, policy) + predicted * policy.repeats > policy.budget_s:
        return LadderStep(None, f"measuring {tokens} would pass the ladder's "
                                f"{policy.budget_s:g} s budget")
    return LadderStep(tokens)


def _eligible(rungs: Sequence[Rung], bounds: Bounds, policy: LadderPolicy) -> list[Rung]:
    """The rungs fast enough for one step and within the memory bound (else the smallest)."""
    memory = memory_bound(rungs, bounds)
    fit = [
        r for r in rungs
        if r.seconds <= policy.max_step_s and (memory is None or r.tokens <= memory)
    ]
    return fit or [min(rungs, key=lambda r: r.tokens)]


def choose(
    rungs: Sequence[Rung], bounds: Bounds, policy: LadderPolicy, stopped: str
) -> PrefillChoice:
    """The smallest eligible rung within the tolerance of the peak throughput, raised to the
    floor; `stopped` is why the ladder stopped, for the reason."""
    if not rungs:
        raise ValueError("choose needs at least one measured rung")
    eligible = _eligible(rungs, bounds, policy)
    peak = max(eligible, key=lambda r: r.throughput)
    tokens = min(r.tokens for r in eligible if r.throughput >= (1 - policy.tolerance) * peak.throughput)
    why = (
        f"prefill throughput measured at {'/'.join(str(r.tokens) for r in rungs)} tokens: "
        f"{'/'.join(f'{r.throughput:.0f}' for r in rungs)} tok/s (ladder stopped: {stopped}); "
        f"{tokens} is the smallest within {policy.tolerance:.0%} of the peak "
        f"({peak.throughput:.0f} tok/s at {peak.tokens})"
    )
    why += _memory_clause(rungs, bounds, policy)
    if tokens < bounds.floor:
        tokens, why = bounds.floor, f"{why}; raised to {bounds.floor}: {bounds.floor_why}"
    return PrefillChoice(tokens, why)


def _memory_clause(rungs: Sequence[Rung], bounds: Bounds, policy: LadderPolicy) -> str:
    """What activation memory allows, when it was measured."""
    memory = memory_bound(rungs, bounds)
    if memory is None:
        return "; activation memory not measured on this device"
    share = bounds.activation_bytes / GiB
    return (f"; activations (measured peak + prompt-logprob logits) fit {memory} tokens in "
            f"{share:.1f} GiB ({policy.activation_share:.0%} of the memory beside the weights)")

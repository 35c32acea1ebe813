"""Where constrained requests' matchers advance and their masks are computed: in a grammar thread
alongside the forward (accelerators), or inline on the engine's thread (the CPU).

On an accelerator the forward leaves the host's cores idle, so the work goes to one grammar
thread (one thread, so a row's work stays in order without locks: its token is consumed before
its next mask is computed); the tokens of a whole batch are consumed, and its masks computed, by
llguidance's own parallel executor in one call each, which releases the GIL, while the engine's
thread launches the next forward and answers the router.

On the CPU the forward's threads hold every core, and torch's OpenMP workers spin between ops
rather than sleep: a grammar thread there only steals the forward's time (even at a lower
priority, where it starved until the forward ended and the engine then waited for it), and
llguidance's executor hands each call to its own pool, which costs more than the work at these
sizes. So the CPU runs it inline, matcher by matcher, on the engine's thread right after a
step's tokens reach the host: measured with `python -m pytgi_bench.experiments.grammar` (batch 64, every
row constrained), 4,096-token vocabulary 0.85x -> 0.91x of the unconstrained tokens/s,
128k-token vocabulary 0.90-0.91x either way; the work itself is ~0.26 ms a step at 64 rows and
4k tokens (consume 0.07, masks 0.19) against ~0.45 ms through the executor.

Matchers are built in a second pool (compile_pool) in both cases, so a large schema compiling
for a request not yet admitted never delays a running batch. The grammar thread where it exists
(with llguidance's threads, spawned by it: Linux threads inherit their creator's nice value)
and the compile pool's thread always run at a lower priority (a higher nice value) than the
process's, so that what the host does for the step comes first: a compile only delays its own
request's admission, while on the CPU a compile at the forward's priority took a core from every
step of the running batch. Only where the OS has per-thread priorities (Linux); elsewhere, and
where raising the value fails, they run as before.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import llguidance
import numpy as np
import torch

from pytgi_shard.structured_output.masks import HostBias


@dataclass(slots=True)
class GrammarTimings:
    """Where constrained steps spend their time, summed over steps (seconds): the grammar work
    (consume: tokens fed to the matchers; mask: llguidance's bitmasks), in the grammar thread or
    inline, and on the engine's thread (handoff: submitting a step's tokens, which inline
    includes consume and mask; wait: waiting for the masks when sampling needs them; convert:
    the words to what sampling applies, the CPU's bias; shared_steps: how many steps' bias was
    made per run of rows sharing a mask, not per row). bench/experiments/grammar.py prints them."""

    steps: int = 0
    shared_steps: int = 0
    consume_s: float = 0.0
    mask_s: float = 0.0
    convert_s: float = 0.0
    handoff_s: float = 0.0
    wait_s: float = 0.0

    def reset(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0 if name.endswith("steps") else 0.0)

    def per_step_ms(self) -> dict[str, float]:
        steps = max(self.steps, 1)
        names = ("consume_s", "mask_s", "convert_s", "handoff_s", "wait_s")
        times = {n.replace("_s", "_ms"): round(getattr(self, n) * 1e3 / steps, 3) for n in names}
        return {**times, "shared_bias_fraction": round(self.shared_steps / steps, 3)}


# How much lower than the process's the grammar threads' priority is (nice units; measured in
# bench/experiments/grammar.py).
GRAMMAR_NICE = 9


def lower_thread_priority(nice: int) -> None:
    """Raises the calling thread's nice value by `nice` (at most 19), on Linux, where a thread's
    id names it alone; elsewhere, or when refused, leaves it."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    thread = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, thread)
        os.setpriority(os.PRIO_PROCESS, thread, min(current + nice, 19))
    except OSError:
        return


T = TypeVar("T")


class MaskWorker:
    """Runs grammar work in order, in the grammar thread or inline (`inline`), and computes
    what it needs of the matchers; also holds the compile pool, the CPU's words-to-bias
    conversion (used on the engine's thread) and the timings."""

    def __init__(self, inline: bool = False, nice: int = GRAMMAR_NICE) -> None:
        # None: inline; the executor exists exactly when the pool does.
        self.pool: ThreadPoolExecutor | None = None
        self.executor: llguidance.LLExecutor | None = None
        if not inline:
            self.pool = ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix="pytgi-grammar",
                initializer=lower_thread_priority,
                initargs=(nice,),
            )
            # Built in the grammar thread: llguidance's threads inherit its priority.
            self.executor = self.pool.submit(llguidance.LLExecutor).result()
        self.compile_pool = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="pytgi-compile",
            initializer=lower_thread_priority,
            initargs=(nice,),
        )
        self.host_bias = HostBias()
        self.timings = GrammarTimings()

    @property
    def inline(self) -> bool:
        return self.pool is None

    @classmethod
    def for_device(cls, device: torch.device, thread: bool | None) -> MaskWorker:
        """The worker for a model on `device`; `thread` None: a grammar thread on accelerators,
        inline on the CPU."""
        return cls(inline=not thread if thread is not None else device.type == "cpu")

    def run(self, fn: Callable[..., T], *args: object) -> Future[T]:
        """`fn(*args)` after every earlier call's: in the grammar thread, or now (its result
        or its exception in the returned future either way)."""
        if self.pool is not None:
            return self.pool.submit(fn, *args)
        done: Future[T] = Future()
        try:
            done.set_result(fn(*args))
        except BaseException as error:  # delivered where the result is read, as from the pool
            done.set_exception(error)
        return done

    def consume(self, matchers: Sequence[llguidance.LLMatcher], tokens: Sequence[int]) -> None:
        """Feeds matchers[i] tokens[i]. A refused token (never one the mask allowed) leaves its
        matcher in the error state, which its next mask reports (grammar_batch._masks)."""
        if self.executor is not None:
            self.executor.consume_token_par(list(zip(matchers, tokens, strict=True)))
            return
        for matcher, token in zip(matchers, tokens, strict=True):
            matcher.consume_token(token)

    def fill_masks(self, matchers: Sequence[llguidance.LLMatcher], words: np.ndarray) -> None:
        """Writes matchers[i]'s next-token bitmask into words[i] ([rows, width] int32, C order)."""
        row_bytes = words.shape[1] * 4
        if self.executor is not None:
            pairs = [(m, i) for i, m in enumerate(matchers)]
            self.executor.unsafe_compute_mask_ptr(pairs, words.ctypes.data, row_bytes, len(pairs))
            return
        base = words.ctypes.data
        for i, matcher in enumerate(matchers):
            matcher.unsafe_compute_mask_ptr(base + i * row_bytes, row_bytes)

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        self.compile_pool.shutdown(wait=False, cancel_futures=True)

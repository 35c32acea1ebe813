"""The shard's grammar thread: where constrained requests' matchers advance and their masks are
computed, off the engine's thread.

One thread, so a row's work stays in order (its token is consumed before its next mask is
computed) without locks; the tokens of a whole batch are consumed, and its masks computed, by
llguidance's own parallel executor in one call each, which releases the GIL, so the engine's
thread runs the forward meanwhile. Grammars are compiled in a second pool (compile_pool), so a
large schema compiling for a request not yet admitted never delays a running batch's masks.

On the CPU the grammar thread's work (~6 ms a step at batch 64) competes with the forward for the
same cores, and a forward thread it preempts stalls its partner at the next barrier. So the
grammar thread, and llguidance's threads (spawned by it: Linux threads inherit their creator's
nice value), run at a lower priority (a higher nice value, `nice` more than the process's): the
scheduler gives them the cores the step leaves idle (its single-threaded Python: answering the
router, building the next inputs) and little of the forward's. Only where the OS has per-thread
priorities (Linux); elsewhere, and where raising the value fails, they run as before.
"""

from __future__ import annotations

import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import llguidance

from pytgi_shard.grammar_masks import HostBias


@dataclass(slots=True)
class GrammarTimings:
    """Where constrained steps spend their time, summed over steps (seconds): in the grammar
    thread (consume: tokens fed to the matchers; mask: llguidance's bitmasks) and on the
    engine's thread (handoff: submitting a step's tokens; wait: waiting for the masks when
    sampling needs them; convert: the words to what sampling applies, the CPU's bias;
    shared_steps: how many steps' bias was made per run of rows sharing a mask, not per row).
    bench/grammar.py prints them."""

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
# bench/grammar.py).
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


class MaskWorker:
    """A single-thread pool for ordered grammar work, llguidance's parallel executor, a
    compile pool, the CPU's words-to-bias conversion (used on the engine's thread) and the
    timings."""

    def __init__(self, nice: int = GRAMMAR_NICE) -> None:
        self.pool = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="pytgi-grammar",
            initializer=lower_thread_priority,
            initargs=(nice,),
        )
        self.compile_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pytgi-compile")
        # Built in the grammar thread: llguidance's threads inherit its priority.
        self.executor: llguidance.LLExecutor = self.pool.submit(llguidance.LLExecutor).result()
        self.host_bias = HostBias()
        self.timings = GrammarTimings()

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.compile_pool.shutdown(wait=False, cancel_futures=True)

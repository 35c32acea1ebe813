"""The shard's grammar thread: where constrained requests' matchers advance and their masks are
computed, off the engine's thread.

One thread, so a row's work stays in order (its token is consumed before its next mask is
computed) without locks; the tokens of a whole batch are consumed, and its masks computed, by
llguidance's own parallel executor in one call each, which releases the GIL, so the engine's
thread runs the forward meanwhile. Grammars are compiled in a second pool (compile_pool), so a
large schema compiling for a request not yet admitted never delays a running batch's masks.
"""

from __future__ import annotations

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


class MaskWorker:
    """A single-thread pool for ordered grammar work, llguidance's parallel executor, a
    compile pool, the CPU's words-to-bias conversion (used on the engine's thread) and the
    timings."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pytgi-grammar")
        self.compile_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pytgi-compile")
        self.executor = llguidance.LLExecutor()
        self.host_bias = HostBias()
        self.timings = GrammarTimings()

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.compile_pool.shutdown(wait=False, cancel_futures=True)

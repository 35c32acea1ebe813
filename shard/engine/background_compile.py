"""Compiled CPU decode steps are made after Warmup, on a thread, while the shard serves.

A cold compile of one bucket takes tens of seconds on a small CPU (make_fx's trace, then
inductor generating and building C++), so compiling every --cpu-graphs size inside Warmup made a
server start take minutes and ran past the router's Warmup deadline. Instead Warmup returns at
once and this thread compiles the buckets smallest first (the single stream, the case a
compiled step helps most, is ready first), each added to the runner as it is done; until then a
bucket's steps run eagerly, exactly as without the flag. The thread runs at a lower CPU priority
(nice 10) so that the steps it shares the cores with keep theirs. A later Warmup (a new cache)
lets the runner go: the thread notices and stops without adding what it compiled.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

from pytgi_shard.attention.kv_cache import KVCache
from pytgi_shard.engine.cpu_graphs import NotCompilable
from pytgi_shard.engine.decode_graphs import DecodeGraphRunner

log = logging.getLogger(__name__)

# The compile thread's niceness: below the serving threads, above nothing.
NICE = 10


def compile_in_background(runner: DecodeGraphRunner, kv_cache: KVCache) -> threading.Thread:
    """Starts compiling `runner`'s buckets over `kv_cache`; the thread is returned (tests join
    it) and kept on the runner as `compiling`."""
    runner.expect_compiled(kv_cache)
    thread = threading.Thread(target=_compile_all, args=(runner, kv_cache),
                              name="cpu-graphs-compile", daemon=True)
    runner.compiling = thread
    thread.start()
    return thread


def _compile_all(runner: DecodeGraphRunner, kv_cache: KVCache) -> None:
    """Every bucket, smallest first, each added as it is compiled; stops at the first refusal
    (the model cannot be compiled: every later bucket would be refused alike) and when the
    runner has let this cache go."""
    _lower_priority()
    start = time.perf_counter()
    try:
        for bucket in runner.buckets:
            began = time.perf_counter()
            step = runner.compile_bucket(bucket, kv_cache)
            if not runner.expects(kv_cache):
                return
            runner.add_compiled(bucket, step)
            log.info("compiled decode step for batch size %d in %.1f s", bucket,
                     time.perf_counter() - began)
    except NotCompilable as e:
        log.warning("compiled decode steps off: %s", e)
        return
    except Exception:
        # A compiler failure must not take the shard down: it decodes eagerly, as before.
        log.exception("compiling decode steps failed; decoding eagerly")
        return
    log.info("compiled decode steps: batch sizes %s in %.0f s", list(runner.buckets),
             time.perf_counter() - start)


def _lower_priority() -> None:
    """This thread (and the compiler processes it starts) at NICE; a no-op where refused."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)

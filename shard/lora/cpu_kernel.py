"""The fused LoRA update for the CPU (cpu_lora.cpp): one C++ call per adapted layer instead of
the segmented path's handful of torch ops, each present slot's A and B read once per group of
rows, the shrink's result kept in a small buffer. On the demo model (hidden 128, where the
update's small matmuls ran at half the base matmul's throughput and per-op dispatch weighed as
much as the arithmetic) it is what brings 8 adapters near the base model's speed
(bench/experiments/lora_batch.py).

Built with torch's extension builder (g++ and ninja) on first use — at shard start-up, when
attach.py wraps the layers of a CPU model — never at import, and cached by torch under its
extensions directory (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions), so later
start-ups load it in well under a second. `-march=native`: the build's name carries a hash of
the source, the compiler flags, torch's version and this CPU's flags, so another CPU sharing
the cache builds its own. When the build fails (no compiler, no ninja, a compiler error) one
warning line is logged and the layers keep the torch path (torch_lora.add_segmented), which
computes the same update.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_lora.cpp")
CFLAGS = ("-O3", "-march=native", "-ffp-contract=fast")


def _cpu_flags() -> str:
    """This CPU's feature flags (Linux), for the build's name: a cached build made with
    -march=native must not be loaded on another CPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def build_name() -> str:
    """The extension's name: a hash of everything that makes the binary differ."""
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(CFLAGS).encode(), torch.__version__.encode(),
                 platform.machine().encode(), _cpu_flags().encode()):
        digest.update(part)
    return "pytgi_lora_cpu_" + digest.hexdigest()[:16]


@functools.cache
def load() -> ModuleType | None:
    """The built extension, or None (one warning logged) when it cannot be built here: the
    caller then uses the torch path. Built once per process, cached on disk across processes."""
    try:
        from torch.utils.cpp_extension import load as build

        return build(name=build_name(), sources=[str(SOURCE)], extra_cflags=list(CFLAGS),
                     verbose=False)
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the torch path
        reason = " ".join(str(exc).split())[:300]
        logger.warning("LoRA: the fused CPU kernel could not be built (%s: %s); the torch ops "
                       "path computes the update instead", type(exc).__name__, reason)
        return None


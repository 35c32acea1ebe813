"""Runs one in-process system of bench/compare/run.py in its own process and writes its result.

`python -m pytgi_bench.compare.system_worker SPEC.json RESULT.json`. A fresh process per system keeps
thread pools, allocator state and imported kernels of one system from colouring another's numbers.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

from pytgi_bench.compare.system_result import SystemResult

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def run_system(spec: dict[str, Any]) -> SystemResult:
    from pytgi_bench.compare import hf_baselines
    from pytgi_bench.compare.inprocess_engine import pytgi_grpc, pytgi_inprocess

    if spec["device"] == "cpu":
        torch.set_num_threads(int(spec["threads"]))
    system = spec["system"]
    model_dir = Path(spec["model_dir"])
    prompts: list[list[int]] = spec["prompts"]
    args = (
        model_dir,
        prompts,
        int(spec["new_tokens"]),
        int(spec["repeats"]),
        DTYPES[spec["dtype"]],
        spec["device"],
    )
    if system == "hf-sequential":
        limit = spec.get("sequential_requests") or len(prompts)
        return hf_baselines.hf_sequential(model_dir, prompts[:limit], *args[2:])
    if system == "hf-static":
        return hf_baselines.hf_static(*args, batch_size=int(spec["static_batch"]))
    if system == "hf-cb":
        # On a GPU transformers' batching is timed on the first cb_requests prompts (see compare).
        limit = spec.get("cb_requests") or len(prompts)
        return hf_baselines.hf_continuous(model_dir, prompts[:limit], *args[2:])
    if system == "hf-compiled-b1":
        single = spec["single_stream"]
        return hf_baselines.hf_compiled_single(
            model_dir, single["prompts"], int(single["new_tokens"]), *args[3:]
        )
    if system == "hf-cb-cpu-patched":
        return hf_baselines.hf_continuous(*args, cpu_memory_bytes=int(spec["cpu_memory_bytes"]))
    if system == "pytgi-inprocess":
        return pytgi_inprocess(*args)
    if system == "pytgi-grpc":
        return pytgi_grpc(*args)
    raise ValueError(f"unknown in-process system {system!r}")


def main(argv: list[str]) -> int:
    spec_path, out_path = Path(argv[0]), Path(argv[1])
    spec = json.loads(spec_path.read_text())
    try:
        result = run_system(spec)
    except Exception as exc:
        traceback.print_exc()
        result = SystemResult(
            spec["system"],
            spec.get("description", ""),
            status="error",
            error=f"{type(exc).__name__}: {exc}",
        )
    out_path.write_text(json.dumps(result.to_json()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

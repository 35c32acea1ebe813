"""pytgi side by side with the alternatives, on the same model, prompts and machine (`make bench`).

Systems (each timed from the first request to the last token, after an untimed warm-up):
  hf-sequential      transformers `generate`, one request at a time
  hf-static          transformers `generate` on static, left-padded batches (default: one of 64)
  hf-cb              transformers continuous batching (`generate_batch`, sdpa_paged), as shipped
  hf-cb-cpu-patched  the same with its memory probe patched so that it runs on CPU
  pytgi-inprocess    pytgi's router Infer + shard Engine in one process (no HTTP, no gRPC)
  pytgi-grpc         the same router core in-process, the shard as its own process over gRPC
  pytgi-http         pytgi end to end: pytgi-launcher, 64 concurrent streaming HTTP clients

CPU mode (default): the bundled demo model (launcher/demo_model) when trained, else the
"cpu-small" random Llama; torch.set_num_threads(2) everywhere; the HTTP load generator shares
the same cores (as in CI). GPU mode (`--gpu`) builds a random-weight Llama-3-8B-shaped model in
bfloat16 on the GPU; that path exists but has not been measured by us (no GPU here).

Every model is made EOS-free (see model_builder), so every system produces exactly
requests x new_tokens tokens; the table flags any system that did not.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from pytgi_bench.comparison_table import check_targets, print_table
from pytgi_bench.model_builder import (
    CPU_SMALL,
    LLAMA3_8B,
    build_random_llama,
    eos_free_copy,
    is_checkpoint,
)
from pytgi_bench.report import machine, save_json
from pytgi_bench.settings import LengthRange
from pytgi_bench.system_result import SystemResult

REPO = Path(__file__).resolve().parent.parent
DEMO_MODEL = REPO / "launcher" / "demo_model"
IN_PROCESS = (
    "hf-sequential",
    "hf-static",
    "hf-cb",
    "hf-cb-cpu-patched",
    "pytgi-inprocess",
    "pytgi-grpc",
)
SYSTEMS = (*IN_PROCESS, "pytgi-http")
_WORKER_TIMEOUT_S = 1800


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench/compare.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--gpu", action="store_true", help="GPU mode: Llama-3-8B-shaped, bfloat16")
    p.add_argument("--model", type=Path, default=None, help="a checkpoint to use instead")
    p.add_argument(
        "--cpu-small",
        action="store_true",
        help="the random cpu-small Llama even if the demo exists",
    )
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument(
        "--input-len",
        type=LengthRange.parse,
        default=LengthRange(16, 64),
        help="prompt tokens: N or LOW:HIGH",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions (median reported)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (CPU mode)")
    p.add_argument("--static-batch", type=int, default=64)
    p.add_argument(
        "--sequential-requests",
        type=int,
        default=None,
        help="time hf-sequential on the first N prompts only (default: all on CPU, 8 "
        "on GPU); its tok/s is what the ratios use",
    )
    p.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma-separated subset of {','.join(SYSTEMS)}",
    )
    p.add_argument(
        "--cpu-memory-gb",
        type=float,
        default=2.0,
        help="memory reported to transformers' CB on CPU (hf-cb-cpu-patched)",
    )
    p.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "pytgi-bench")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="results JSON (default bench/results/compare-{cpu,gpu}.json)",
    )
    p.add_argument("--note", default="", help="free text saved with the results")
    return p


def resolve_model(args: argparse.Namespace) -> tuple[Path, str]:
    """The EOS-free checkpoint every system loads, and a description of it."""
    work = args.work_dir
    if args.gpu:
        if not torch.cuda.is_available():
            raise SystemExit("--gpu: no CUDA device is available")
        path = build_random_llama(
            work / LLAMA3_8B.name, LLAMA3_8B, DEMO_MODEL, dtype=torch.bfloat16, device="cuda"
        )
        return path, f"random {LLAMA3_8B.name} (bfloat16)"
    if args.model is not None:
        return eos_free_copy(args.model, work / f"{args.model.name}-eos-free"), str(args.model)
    if is_checkpoint(DEMO_MODEL) and not args.cpu_small:
        return eos_free_copy(DEMO_MODEL, work / "demo-eos-free"), "bundled demo model"
    path = build_random_llama(work / CPU_SMALL.name, CPU_SMALL, DEMO_MODEL)
    return path, f"random {CPU_SMALL.name} Llama (hidden 256, 4 layers, 4/2 heads, inter 768)"


def build_prompts(
    model_dir: Path, count: int, input_len: LengthRange
) -> list[tuple[str, list[int]]]:
    """Prompt texts of the drawn token lengths, and their token ids (BOS included) — the ids
    every in-process system gets, and the texts the HTTP run sends (the router re-encodes them
    to the same ids with the same tokenizer)."""
    from tokenizers import Tokenizer

    from pytgi_bench.token_aligner import LocalTokenCounter
    from pytgi_bench.workload import build_workload

    counter = LocalTokenCounter(model_dir)
    workload = asyncio.run(build_workload(count, input_len, LengthRange(1, 2), counter, None, 0))
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return [(item.prompt, tokenizer.encode(item.prompt).ids) for item in workload.items]


def run_in_process(system: str, spec: dict[str, Any], work: Path) -> SystemResult:
    spec_path, out_path = work / f"{system}.spec.json", work / f"{system}.result.json"
    spec_path.write_text(json.dumps({**spec, "system": system}))
    out_path.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytgi_bench.system_worker", str(spec_path), str(out_path)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=_WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return SystemResult(system, "", status="error", error=f"timed out ({_WORKER_TIMEOUT_S} s)")
    if not out_path.is_file():
        tail = "\n".join(done.stderr.splitlines()[-15:])
        return SystemResult(
            system, "", status="error", error=f"worker exited with {done.returncode}: {tail}"
        )
    return SystemResult.from_json(json.loads(out_path.read_text()))


def _merge(into: SystemResult | None, new: SystemResult) -> SystemResult:
    """Adds one round's result to a system's results (the HTTP row keeps each round's latency)."""
    latency = new.extra.pop("latency", None)
    if into is None:
        into = new
    else:
        into.wall_s.extend(new.wall_s)
        into.output_tokens.extend(new.output_tokens)
        if not new.ok and into.status == "ok":
            into.status, into.error = new.status, new.error
    if latency is not None:
        into.extra.setdefault("latency_per_round", []).append(latency)
    return into


def run_rounds(
    systems: list[str],
    spec: dict[str, Any],
    model_dir: Path,
    prompts: list[tuple[str, list[int]]],
    args: argparse.Namespace,
) -> list[SystemResult]:
    """`repeats` rounds, each timing every system once, so that load from other users of a shared
    machine spreads over all systems instead of colouring whichever ran at the wrong moment."""
    from pytgi_bench.http_system import HttpSystem

    merged: dict[str, SystemResult | None] = dict.fromkeys(systems)
    http = HttpSystem(
        model_dir,
        prompts,
        args.new_tokens,
        args.work_dir,
        threads=None if args.gpu else args.threads,
        keep_running=not args.gpu,
    )
    try:
        for round_index in range(args.repeats):
            for system in systems:
                if system == "hf-cb-cpu-patched" and args.gpu:
                    continue
                previous = merged[system]
                if previous is not None and not previous.ok:
                    continue  # N/A or broken once: no point in asking again
                print(
                    f"[compare] round {round_index + 1}/{args.repeats}: {system}",
                    file=sys.stderr,
                    flush=True,
                )
                # 1-minute load average before the round: how busy the shared machine was.
                load = round(os.getloadavg()[0], 2)
                if system == "pytgi-http":
                    result = http.run_once()
                else:
                    result = run_in_process(system, {**spec, "repeats": 1}, args.work_dir)
                combined = _merge(previous, result)
                combined.extra.setdefault("loadavg_before_round", []).append(load)
                merged[system] = combined
    finally:
        http.close()
    return [r for r in merged.values() if r is not None]


def versions() -> dict[str, str]:
    import transformers

    from pytgi_router.state import package_version

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "pytgi": package_version(),
        "python": platform.python_version(),
    }


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # SystemExit unwinds through the `finally` that stops the pytgi server we started.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        raise SystemExit(
            f"unknown systems: {', '.join(unknown)} (choose from {', '.join(SYSTEMS)})"
        )
    args.work_dir.mkdir(parents=True, exist_ok=True)
    if not args.gpu:
        torch.set_num_threads(args.threads)
    model_dir, model_desc = resolve_model(args)
    prompts = build_prompts(model_dir, args.requests, args.input_len)
    spec = {
        "model_dir": str(model_dir),
        "prompts": [ids for _, ids in prompts],
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "threads": args.threads,
        "device": "cuda" if args.gpu else "cpu",
        "dtype": "bfloat16" if args.gpu else "float32",
        "static_batch": args.static_batch,
        "sequential_requests": args.sequential_requests or (8 if args.gpu else None),
        "cpu_memory_bytes": int(args.cpu_memory_gb * 2**30),
    }
    results = run_rounds(systems, spec, model_dir, prompts, args)
    expected = args.requests * args.new_tokens
    for r in results:
        timed = len(prompts)
        if r.system == "hf-sequential" and spec["sequential_requests"]:
            # GPU mode times hf-sequential on a prefix of the prompts; its tok/s stands for all.
            timed = min(timed, spec["sequential_requests"])
        r.extra["expected_tokens"] = timed * args.new_tokens
    print_table(results, expected, sys.stdout)
    out = args.out or REPO / "bench" / "results" / f"compare-{'gpu' if args.gpu else 'cpu'}.json"
    save_json(
        {
            "tool": "bench/compare.py",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(),
            "versions": versions(),
            "note": args.note,
            "mode": "gpu" if args.gpu else "cpu",
            "threads": None if args.gpu else args.threads,
            "model": {
                "path": str(model_dir),
                "description": model_desc,
                "config": json.loads((model_dir / "config.json").read_text()),
            },
            "workload": {
                "requests": args.requests,
                "new_tokens": args.new_tokens,
                "input_len": str(args.input_len),
                "repeats": args.repeats,
                "prompt_tokens": [len(ids) for _, ids in prompts],
            },
            "results": [r.to_json() for r in results],
            "targets": [c.to_json() for c in check_targets(results)],
        },
        out,
    )
    print(f"results: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

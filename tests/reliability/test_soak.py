"""Soak: many requests at high concurrency, mixing /generate, /generate_stream and chat (both
ways), with 10% of clients disconnecting mid-stream or mid-/generate. Checks zero unexpected
errors, every KV block free and the batch empty at the end, and bounded RSS growth of the router
and the shard after a warm-up.

CI runs the short form (300 requests at concurrency 32); PYTGI_SLOW=1 the issue's long form
(2,000 at 64). The numbers are printed (`pytest -s`).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from tests.integration.http_helpers import metric
from tests.router_process import RouterProcess
from tests.shard_process import ShardProcesses

SLOW = os.environ.get("PYTGI_SLOW") == "1"
REQUESTS, CONCURRENCY = (2000, 64) if SLOW else (300, 32)
WARMUP = 100
DISCONNECT_RATE = 0.1
# RSS growth allowed after the warm-up; allocator noise is a few MB, a per-request leak of even
# 10 KB would show as 20 MB over the long form.
RSS_BOUND_MB = 25.0
PROMPTS = ["The quick brown fox", "To be, or not to be", "Hello world!", "Unicode: café 中文",
           "def main():", "Numbers: 0 1 2 3 4 5 6 7 8 9", "symbols: {}[]()", "Привет, мир"]
KINDS = ("generate", "stream", "chat", "chat_stream")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


@dataclass(frozen=True)
class Plan:
    kind: str
    prompt: str
    new_tokens: int
    # None: read to the end; else disconnect after this many events (streams) or seconds.
    disconnect_after: float | None


def plans(count: int, seed: int) -> list[Plan]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        kind = rng.choice(KINDS)
        cut: float | None = None
        if rng.random() < DISCONNECT_RATE:
            cut = rng.uniform(0.02, 0.3) if kind in ("generate", "chat") else rng.randint(1, 8)
        out.append(Plan(kind, rng.choice(PROMPTS), rng.randint(1, 32), cut))
    return out


def body(plan: Plan) -> tuple[str, dict[str, object]]:
    if plan.kind in ("generate", "stream"):
        path = "/generate" if plan.kind == "generate" else "/generate_stream"
        return path, {"inputs": plan.prompt, "parameters": {"max_new_tokens": plan.new_tokens}}
    return "/v1/chat/completions", {
        "messages": [{"role": "user", "content": plan.prompt}], "max_tokens": plan.new_tokens,
        "stream": plan.kind == "chat_stream", "temperature": 0.7, "seed": 1}


async def hang_up(url: str, path: str, payload: dict[str, object], after: float) -> str:
    """Sends a non-streaming request on a raw connection and closes it `after` s later."""
    where = urlparse(url)
    reader, writer = await asyncio.open_connection(where.hostname, where.port)
    raw = json.dumps(payload).encode()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
    await writer.drain()
    await asyncio.sleep(after)
    writer.close()
    await writer.wait_closed()
    return "disconnected"


async def one(client: httpx.AsyncClient, url: str, plan: Plan) -> str:
    """"ok", "disconnected", or a description of what went wrong."""
    path, payload = body(plan)
    if plan.kind in ("generate", "chat"):
        if plan.disconnect_after is not None:
            return await hang_up(url, path, payload, plan.disconnect_after)
        r = await client.post(f"{url}{path}", json=payload)
        if r.status_code != 200:
            return f"{plan.kind} {r.status_code}: {r.text}"
        answer = r.json()
        text = answer["generated_text"] if plan.kind == "generate" else \
            answer["choices"][0]["message"]["content"]
        return "ok" if isinstance(text, str) else f"{plan.kind}: no text in {answer}"
    events = 0
    async with client.stream("POST", f"{url}{path}", json=payload) as r:
        if r.status_code != 200:
            return f"{plan.kind} {r.status_code}: {(await r.aread())!r}"
        last = ""
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            events += 1
            last = line[5:].strip()
            if '"error"' in last:
                return f"{plan.kind} error event: {last}"
            if plan.disconnect_after is not None and events >= plan.disconnect_after:
                return "disconnected"  # leaving the block closes the connection mid-stream
    if plan.kind == "stream" and json.loads(last).get("generated_text") is None:
        return f"stream ended without its final event: {last}"
    if plan.kind == "chat_stream" and last != "[DONE]":
        return f"chat stream ended without [DONE]: {last}"
    return "ok"


async def run(url: str, batch: list[Plan], concurrency: int) -> Counter[str]:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        async def guarded(plan: Plan) -> str:
            async with gate:
                try:
                    return await one(client, url, plan)
                except httpx.HTTPError as err:
                    return f"{plan.kind}: {type(err).__name__} {err} at {time.time():.3f}"

        return Counter(await asyncio.gather(*(guarded(p) for p in batch)))


@pytest.fixture(scope="module")
def router(shard: ShardProcesses, llama: Path) -> Iterator[RouterProcess]:
    with RouterProcess(shard.urls[0], llama, "--max-input-tokens", "100",
                       "--max-total-tokens", "200") as process:
        yield process


def settle(url: str, timeout: float = 30.0) -> None:
    """Until the disconnected requests have left their batch and everything is free."""
    deadline = time.monotonic() + timeout
    while metric(url, "pytgi_kv_blocks_free") != metric(url, "pytgi_kv_blocks_total"):
        assert time.monotonic() < deadline, "KV blocks were not all freed"
        time.sleep(0.1)


def test_soak(router: RouterProcess, shard: ShardProcesses) -> None:
    url = router.url
    assert router.proc is not None
    pids = {"router": router.proc.pid, "shard": shard.procs[0].pid}
    warm = asyncio.run(run(url, plans(WARMUP, seed=1), CONCURRENCY))
    assert set(warm) <= {"ok", "disconnected"}, warm
    settle(url)
    before = {name: rss_mb(pid) for name, pid in pids.items()}
    dropped_before = metric(url, "tgi_request_failure", err="dropped")
    batch = plans(REQUESTS, seed=2)
    start = time.monotonic()
    outcomes = asyncio.run(run(url, batch, CONCURRENCY))
    elapsed = time.monotonic() - start
    unexpected = {k: v for k, v in outcomes.items() if k not in ("ok", "disconnected")}
    complaints = [line for line in router.output.splitlines() if " INFO " not in line]
    assert not unexpected, (unexpected, complaints[-40:])
    # A stream shorter than its planned cut ends normally before the client hangs up.
    assert outcomes["ok"] >= sum(p.disconnect_after is None for p in batch)
    settle(url)
    after = {name: rss_mb(pid) for name, pid in pids.items()}
    dropped = metric(url, "tgi_request_failure", err="dropped") - dropped_before
    print(f"\nsoak: {REQUESTS} requests at concurrency {CONCURRENCY} in {elapsed:.1f}s "
          f"({REQUESTS / elapsed:.1f} req/s): {dict(outcomes)}, {dropped:.0f} dropped by the "
          f"router; RSS MB before {before} after {after}")
    # Some disconnects land after their request finished: dropped can be fewer, never more.
    assert 0 < dropped <= outcomes["disconnected"]
    assert metric(url, "tgi_batch_current_size") == 0
    assert metric(url, "tgi_queue_size") == 0
    for method in ("prefill", "decode"):
        assert metric(url, "tgi_batch_inference_failure", method=method) == 0
    for name in pids:
        assert after[name] - before[name] < RSS_BOUND_MB, (name, before, after)
    assert httpx.get(f"{url}/health").status_code == 200

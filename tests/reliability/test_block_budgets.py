"""Issue 11 item 2 over HTTP: token budgets that are not whole KV blocks (500 = 31.25 blocks of
16) used to leave `POST /generate` unanswered forever, with the FIFO queue jammed behind it."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.router_process import RouterProcess
from tests.shard_process import ShardProcesses


def test_a_budget_of_partial_blocks_serves_requests(shard: ShardProcesses, llama: Path) -> None:
    flags = ("--max-batch-total-tokens", "500", "--max-total-tokens", "500",
             "--max-batch-prefill-tokens", "500")
    with RouterProcess(shard.urls[0], llama, *flags) as router:
        info = httpx.get(f"{router.url}/info").json()
        assert info["max_total_tokens"] == 500 and info["max_batch_total_tokens"] == 512
        for _ in range(2):  # the second one proves the queue behind the first is not jammed
            r = httpx.post(f"{router.url}/generate", json={"inputs": "hi"}, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["generated_text"]

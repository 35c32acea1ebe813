"""Repeated prompts through Infer and a real `pytgi-shard serve` on the tiny llama (blocks of 16
tokens): a prompt run twice generates the same tokens, and its second run's full blocks replace
the first run's in the prefix cache (the router's tables, and so the shard's, never change). The
KV in those adopted blocks must be exactly what the tokens give: a continuation that hits them
streams what it streams with prefix caching off."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from tests.integration.test_router_infer import PROMPTS, serving
from tests.integration.test_router_kv_on_demand import (
    config,
    drained,
    events_of,
    metric,
    request,
    summary,
)
from tests.shard_process import ShardProcesses, start_shards

PROMPT_LEN = 40  # two whole blocks and a partial one
NEW = 50


@pytest.fixture(scope="module")
def llama(tiny_model: Callable[..., Path]) -> Path:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def llama_shards(llama: Path) -> Iterator[ShardProcesses]:
    with start_shards(llama) as processes:
        yield processes


def test_a_repeated_prompt_s_adopted_blocks_serve_a_continuation_exactly(
    llama_shards: ShardProcesses, llama: Path
) -> None:
    tokenizer = Tokenizer.from_file(str(llama / "tokenizer.json"))
    prompt = tokenizer.encode(" ".join(PROMPTS)).ids[:PROMPT_LEN]
    turn_ids = tokenizer.encode(" And then?").ids

    async def main() -> dict[bool, tuple[object, ...]]:
        outputs: dict[bool, tuple[object, ...]] = {}
        for caching in (False, True):
            async with serving(llama_shards, config(caching=caching)) as infer:
                first = summary(await events_of(infer, request(prompt, NEW)))
                second = summary(await events_of(infer, request(prompt, NEW)))
                assert second == first
                turn = prompt + first[0] + turn_ids
                third = summary(await events_of(infer, request(turn, 20)))
                cached = metric(infer, "pytgi_request_cached_tokens_sum")
                # The second run hits the prompt's whole blocks; the turn, every full block of
                # the second run's KV (prompt + NEW - 1 tokens written).
                expected = (PROMPT_LEN - 1) // 16 * 16 + (PROMPT_LEN + NEW - 1) // 16 * 16
                assert cached == (expected if caching else 0)
                await drained(infer)
                outputs[caching] = (first, third)
        return outputs

    outputs = asyncio.run(main())
    assert outputs[True] == outputs[False]

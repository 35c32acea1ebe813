"""--speculator-model over real HTTP: one shard process of the tiny Llama drafting with a draft
model (the tiny Llama itself, given as its own --speculator-model, env SPECULATOR_MODEL) behind a
router that prefills in chunks of 16 tokens, against the same server without speculation.

Greedy requests give exactly the reference's tokens, on prompts that repeat themselves and ones
that do not, again from the prefix cache; the target drafting for itself keeps every draft
(/metrics), which the draft's own KV cache (sized beside the target's at Warmup, written by
each request's drafting) must hold right for.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.speculative_cases import (
    PLAIN,
    REPEATING,
    chunked_server,
    generate,
    ids,
    metric,
)


@pytest.fixture(scope="module")
def url(model: Path) -> Iterator[str]:
    with chunked_server(model, ["--speculate", "3"], {"SPECULATOR_MODEL": str(model)}) as served:
        yield served


@pytest.fixture(scope="module")
def plain(model: Path) -> Iterator[str]:
    with chunked_server(model) as served:
        yield served


def test_greedy_tokens_equal_the_plain_server_s_and_every_draft_is_kept(
    url: str, plain: str
) -> None:
    assert httpx.get(f"{url}/info", timeout=30).json()["speculate"] == 3
    for prompt in (REPEATING, PLAIN):
        expected = ids(generate(plain, prompt, max_new_tokens=40))
        assert ids(generate(url, prompt, max_new_tokens=40)) == expected
        # Again: the prompt's blocks now come from the prefix cache.
        assert ids(generate(url, prompt, max_new_tokens=40)) == expected
    drafted = metric(url, "pytgi_speculative_drafted_tokens")
    assert drafted > 0
    assert metric(url, "pytgi_speculative_accepted_tokens") == drafted

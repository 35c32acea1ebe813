"""Hostile grammars through a real router and shard (issue "Hardening II", items 1-3): a grammar
that allows no output, or is over the size limit, is a 422 before any shard compiles it; a
request whose matcher fails mid-output ends with a generation error (424, the reason, logged by
router and shard), not eos_token and text its grammar refuses; and the next request of the same
grammar is served as if nothing happened (the grammar's matchers shared a lexer, so one failure
used to leave every later request one empty EOS token until the shard restarted). Requests
beside a failing one go on."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.http_helpers import sse_events
from tests.router_process import RouterProcess
from tests.shard_process import ShardProcesses
from tests.unit.shard.structured_output.test_grammar_prepare import HOSTILE

PROMPT = "Answer in JSON:"


@pytest.fixture(scope="module")
def router(shards: ShardProcesses, model: Path) -> Iterator[RouterProcess]:
    with RouterProcess(shards.urls[0], model, "--max-total-tokens", "256",
                       "--max-input-tokens", "64", "--max-grammar-bytes", "20000") as r:
        yield r


def generate(url: str, grammar: dict[str, Any] | None, **parameters: Any) -> httpx.Response:
    body = {"inputs": PROMPT, "parameters": {"grammar": grammar, "details": True, **parameters}}
    return httpx.post(f"{url}/generate", json=body, timeout=120)


def json_grammar(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json", "value": schema}


@pytest.mark.parametrize("grammar", [
    {"type": "regex", "value": "[a&&b]"},
    {"type": "regex", "value": r"[^\x00-\x{10FFFF}]"},
    json_grammar({"$ref": "#"}),
])  # fmt: skip
def test_a_grammar_that_allows_no_output_is_a_422(router: RouterProcess, grammar: Any) -> None:
    r = generate(router.url, grammar, max_new_tokens=4)
    assert r.status_code == 422, r.text
    assert r.json() == {"error": "Input validation error: grammar is not valid: no output can "
                                 "match it", "error_type": "validation"}


def test_a_grammar_over_the_size_limit_is_a_422_at_once(router: RouterProcess) -> None:
    big = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(10_000)}}
    start = time.monotonic()
    r = generate(router.url, json_grammar(big), max_new_tokens=4)
    assert r.status_code == 422 and r.json()["error_type"] == "validation"
    assert "longer than 20000 bytes, this server's limit (--max-grammar-bytes)" in r.json()["error"]
    assert time.monotonic() - start < 2.0  # validating it took seconds, compiling it tens


def failed_request(url: str) -> httpx.Response:
    """The first of a few seeds that drives the tiny model into the pattern's lexer limit."""
    for seed in range(8):
        r = generate(url, json_grammar(HOSTILE), do_sample=True, seed=seed, max_new_tokens=200)
        if r.status_code != 200:
            return r
    raise AssertionError("no seed made the matcher fail")


def test_a_failed_matcher_is_a_generation_error_and_the_grammar_serves_the_next(
    router: RouterProcess,
) -> None:
    r = failed_request(router.url)
    assert r.status_code == 424, r.text
    assert r.json() == {
        "error": "Request failed during generation: the grammar's matcher failed: lexer error: "
                 "too many expressions constructed",
        "error_type": "generation",
    }  # fmt: skip
    assert router.logged("too many expressions constructed")
    for seed in (11, 12):
        again = generate(router.url, json_grammar(HOSTILE), do_sample=True, seed=seed,
                         max_new_tokens=8)  # fmt: skip
        assert again.status_code == 200, again.text
        details = again.json()["details"]
        if details["finish_reason"] == "eos_token":
            json.loads(again.json()["generated_text"])
        else:
            assert (details["finish_reason"], details["generated_tokens"]) == ("length", 8)


def test_a_streamed_failure_ends_its_stream_and_its_neighbours_go_on(router: RouterProcess) -> None:
    """Streamed, the error is the stream's last event, after the tokens sent (none of them a
    final text); a free request sent alongside finishes."""

    def stream(seed: int) -> list[Any]:
        parameters = {"grammar": json_grammar(HOSTILE), "do_sample": True, "seed": seed,
                      "max_new_tokens": 200}  # fmt: skip
        body = {"inputs": PROMPT, "parameters": parameters}
        with httpx.stream("POST", f"{router.url}/generate_stream", json=body, timeout=120) as r:
            assert r.status_code == 200
            return list(sse_events(r))

    def first_failure() -> list[Any]:
        return next(events for events in map(stream, range(8)) if "error" in events[-1])

    with ThreadPoolExecutor(2) as pool:
        streamed = pool.submit(first_failure)
        free = pool.submit(generate, router.url, None, max_new_tokens=40, ignore_eos_token=True)
        events, neighbour = streamed.result(), free.result()
    assert events[-1]["error_type"] == "generation"
    assert "too many expressions constructed" in events[-1]["error"]
    assert len(events) > 2 and not any(e.get("generated_text") for e in events[:-1])
    assert neighbour.status_code == 200 and neighbour.json()["details"]["generated_tokens"] == 40

"""Tool calls end to end through a real pytgi-router and shard on the tiny random Llama (it
knows nothing: what it writes is the grammar's doing). Two tools that both define `$defs/X`
(an integer, an enum): every call follows its own tool's `X`. A call cut short is reported as
cut, streamed or not: `length` at `max_tokens`, a tool_error when a stop sequence cuts it,
never `finish_reason: "tool_calls"` with arguments that are not the tool's JSON."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from tests.integration.http_helpers import sse_events
from tests.integration.structured_cases import LIMITS, MESSAGES, TOOL_PROMPT, TOOL_TEMPLATE, TOOLS
from tests.router_process import RouterProcess
from tests.shard_process import start_shards


def defs_tool(name: str, x: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/X"}}, "required": ["x"],
        "$defs": {"X": x}}}}


FIRST = defs_tool("first", {"type": "integer", "minimum": 0, "maximum": 99})
SECOND = defs_tool("second", {"enum": ["SURPRISE"]})
OWN_SCHEMA = {t["function"]["name"]: t["function"]["parameters"] for t in (FIRST, SECOND)}
SEEDS = range(12)


@pytest.fixture(scope="module")
def url(tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[str]:
    model = tiny_model("llama")
    config = json.loads((model / "tokenizer_config.json").read_text())
    path = tmp_path_factory.mktemp("config") / "tokenizer_config.json"
    path.write_text(json.dumps({**config, "chat_template": TOOL_TEMPLATE}))
    with start_shards(model) as shards, RouterProcess(
            shards.urls[0], model, *LIMITS, "--tokenizer-config-path", str(path)) as router:
        yield router.url


def body(seed: int, tools: list[Any], **extra: Any) -> dict[str, Any]:
    return {"messages": MESSAGES, "max_tokens": 120, "seed": seed, "temperature": 1.0,
            "tools": tools, "tool_choice": "required", "tool_prompt": TOOL_PROMPT, **extra}


def chat(url: str, request: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json=request, timeout=120)


def stream(url: str, request: dict[str, Any]) -> list[Any]:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**request, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        events = list(sse_events(r))
    assert events[-1] == "[DONE]"
    return events[:-1]


def test_each_tool_follows_its_own_definitions(url: str) -> None:
    """The first tool's `x` is its own integer every time (the merged definitions made 9 of 12
    calls to it `"SURPRISE"`), the second's its own enum; a tool named `a%20b` is served."""
    with ThreadPoolExecutor(12) as pool:
        out = list(pool.map(lambda s: chat(url, body(s, [FIRST, SECOND])), SEEDS))
    calls: dict[str, int] = {"first": 0, "second": 0}
    for r in out:
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "length":
            continue
        assert choice["finish_reason"] == "tool_calls", choice
        [call] = choice["message"]["tool_calls"]
        name = call["function"]["name"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), OWN_SCHEMA[name])
        calls[name] += 1
    assert calls["first"] >= 1 and sum(calls.values()) * 2 >= len(SEEDS), calls
    odd = defs_tool("a%20b", {"type": "integer"})
    r = chat(url, body(0, [odd, SECOND], tool_choice="a%20b"))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("tool_calls", "length")


def test_a_call_cut_by_max_tokens_is_length(url: str) -> None:
    """Not even the call's arguments fit in 12 tokens: "length", streamed and not, with the
    call as far as it went (its arguments not JSON) or nothing (TGI's 422 before)."""
    for seed in range(4):
        request = body(seed, TOOLS, max_tokens=12)
        r = chat(url, request)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length"
        for call in choice["message"].get("tool_calls") or []:
            with pytest.raises(ValueError):
                json.loads(call["function"]["arguments"])
        chunks = [e["choices"][0] for e in stream(url, request) if e.get("choices")]
        assert [c["finish_reason"] for c in chunks if c["finish_reason"]] == ["length"]


def test_a_call_cut_by_a_stop_sequence_is_a_tool_error(url: str) -> None:
    """`get_time`'s one argument is named "zone": a stop sequence on it cuts every call inside
    its arguments. A tool_error (422), streamed as an error event after the deltas sent, not a
    call."""
    request = body(0, TOOLS, tool_choice="get_time", stop=['"zone"'])
    r = chat(url, request)
    assert r.status_code == 422, r.text
    assert r.json()["error_type"] == "tool_error"
    assert "a stop sequence ended the output before its tool call was complete" in r.json()[
        "error"]
    events = stream(url, request)
    assert events[-1]["error"]["type"] == "tool_error"
    assert not any(c["finish_reason"] for e in events for c in e.get("choices", []))

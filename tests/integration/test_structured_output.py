"""Structured output end to end (issue 14): a real pytgi-router in front of a real shard on the
tiny, randomly initialised Llama — it knows nothing, so every valid output is the grammar's doing.
Every output that ends by its grammar (finish reason eos_token) must validate against its JSON
schema (jsonschema) or fullmatch its regex: on /generate, /generate_stream, chat with
response_format, completions, tools under each tool_choice, streamed tool calls, and a batch that
mixes constrained and free requests. Bad grammars are 422s that name the problem."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import httpx
import jsonschema
import pytest

from tests.integration.http_helpers import sse_events
from tests.integration.structured_cases import (
    LIMITS,
    MESSAGES,
    PARAMETERS,
    REGEXES,
    SCHEMAS,
    TOOL_PROMPT,
    TOOL_TEMPLATE,
    TOOLS,
)
from tests.router_process import RouterProcess
from tests.shard_process import ShardProcesses, start_shards

T = TypeVar("T")
R = TypeVar("R")

MAX_NEW = 160
SEEDS = range(4)

@pytest.fixture(scope="module")
def tool_config(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = json.loads((model / "tokenizer_config.json").read_text())
    path = tmp_path_factory.mktemp("config") / "tokenizer_config.json"
    path.write_text(json.dumps({**config, "chat_template": TOOL_TEMPLATE}))
    return path


@pytest.fixture(scope="module")
def url(shards: ShardProcesses, model: Path, tool_config: Path) -> Iterator[str]:
    with RouterProcess(shards.urls[0], model, *LIMITS,
                       "--tokenizer-config-path", str(tool_config)) as router:
        yield router.url


def post(url: str, path: str, body: Any) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def ok(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    return dict(r.json())


def concurrently(fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """Sent together, so that the router batches them."""
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(fn, items))


def post_all(url: str, path: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return concurrently(lambda body: ok(post(url, path, body)), bodies)


def validates(schema: dict[str, Any], text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def sampled(seed: int) -> dict[str, Any]:
    return {"max_new_tokens": MAX_NEW, "do_sample": True, "seed": seed, "details": True}


def assert_ended_outputs_valid(results: list[tuple[str, str]], ok_text: Callable[[str], bool]
                               ) -> None:
    """(finish_reason, text): every output ended by its grammar is valid, and most end so."""
    ended = [text for reason, text in results if reason == "eos_token"]
    assert all(ok_text(t) for t in ended), [t for t in ended if not ok_text(t)]
    assert len(ended) * 2 >= len(results), results


# ---- /generate and /generate_stream ------------------------------------------------------------


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_generate_json_schema_outputs_validate(url: str, name: str) -> None:
    schema = SCHEMAS[name]
    forms = [{"type": "json", "value": schema}, {"type": "json", "value": json.dumps(schema)},
             {"type": "json_schema", "value": {"name": name, "schema": schema}},
             {"type": "json_object", "value": schema}]
    bodies = [{"inputs": "Give me JSON:", "parameters": {**sampled(seed), "grammar": form}}
              for seed in SEEDS for form in forms[seed % len(forms):][:1]]
    out = post_all(url, "/generate", bodies)
    assert_ended_outputs_valid(
        [(o["details"]["finish_reason"], o["generated_text"]) for o in out],
        lambda t: validates(schema, t))


@pytest.mark.parametrize("regex", REGEXES)
def test_generate_stream_regex_outputs_fullmatch(url: str, regex: str) -> None:
    def one(seed: int) -> tuple[str, str]:
        body = {"inputs": "Answer:", "parameters": {
            **sampled(seed), "grammar": {"type": "regex", "value": regex}}}
        with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=120) as r:
            assert r.status_code == 200
            events = list(sse_events(r))
        last = events[-1]
        streamed = "".join(e["token"]["text"] for e in events if not e["token"]["special"])
        assert streamed == last["generated_text"]
        return last["details"]["finish_reason"], last["generated_text"]

    results = concurrently(one, SEEDS)
    assert_ended_outputs_valid(results, lambda t: re.fullmatch(regex, t) is not None)


def test_greedy_regex_ends_and_matches(url: str) -> None:
    out = ok(post(url, "/generate", {"inputs": "Phone:", "parameters": {
        "max_new_tokens": 40, "details": True,
        "grammar": {"type": "regex", "value": REGEXES[0]}}}))
    assert out["details"]["finish_reason"] == "eos_token"
    assert re.fullmatch(REGEXES[0], out["generated_text"])


def test_a_batch_mixing_constrained_and_free_requests(url: str) -> None:
    """Free requests answer exactly as they do alone; constrained ones still validate."""
    free = {"inputs": "The quick brown fox", "parameters": {"max_new_tokens": 24, "details": True}}
    alone = ok(post(url, "/generate", free))
    schema = SCHEMAS["enum_and_bounded_array"]
    bodies: list[dict[str, Any]] = []
    for seed in SEEDS:
        bodies.append(free)
        bodies.append({"inputs": "JSON:", "parameters": {
            **sampled(seed), "grammar": {"type": "json", "value": schema}}})
        bodies.append({"inputs": "Code:", "parameters": {
            **sampled(seed), "grammar": {"type": "regex", "value": REGEXES[0]}}})
    out = post_all(url, "/generate", bodies)
    for o in out[0::3]:
        assert [t["id"] for t in o["details"]["tokens"]] == [
            t["id"] for t in alone["details"]["tokens"]]
    assert_ended_outputs_valid(
        [(o["details"]["finish_reason"], o["generated_text"]) for o in out[1::3]],
        lambda t: validates(schema, t))
    assert_ended_outputs_valid(
        [(o["details"]["finish_reason"], o["generated_text"]) for o in out[2::3]],
        lambda t: re.fullmatch(REGEXES[0], t) is not None)


# ---- OpenAI routes: response_format ------------------------------------------------------------


def chat_body(seed: int, **extra: Any) -> dict[str, Any]:
    body = {"messages": MESSAGES, "max_tokens": MAX_NEW, "seed": seed, "temperature": 1.0,
            **extra}
    return {**body, "tool_prompt": TOOL_PROMPT} if "tools" in extra else body


def test_the_prompt_carries_the_tools(url: str) -> None:
    """The template renders `tools` (with no_tool under "auto"): only the tool prompt is
    appended to the last message."""
    for choice, count in (("auto", 3), ("required", 2), ("get_time", 1)):
        r = ok(post(url, "/chat_tokenize", chat_body(0, tools=TOOLS, tool_choice=choice)))
        assert f"<|tools|>{count}\n" in r["templated_text"]
        assert f"{MESSAGES[0]['content']}\n---\n{TOOL_PROMPT}</s>" in r["templated_text"]
    r = ok(post(url, "/chat_tokenize", chat_body(0, tools=TOOLS, tool_choice="none")))
    assert "<|tools|>" not in r["templated_text"] and "---" not in r["templated_text"]


def test_a_template_without_tools_gets_them_as_json(url: str, model: Path) -> None:
    """TGI's rule for templates that do not render `tools`: their JSON and the tool prompt are
    appended to the last message."""
    from pytgi_router.http.model_files import ModelFiles
    from pytgi_router.http.openai.chat_template import load_chat_template

    template = load_chat_template(ModelFiles(str(model), None))
    assert template is not None and not template.uses_tools
    del url  # the HTTP side is the same code; the default template is too long for 256 tokens



def test_chat_response_format_json_schema_and_json_object(url: str) -> None:
    schema = SCHEMAS["nested"]
    fmt_schema = {"type": "json_schema",
                  "json_schema": {"name": "person", "schema": schema, "strict": True}}
    out = post_all(url, "/v1/chat/completions",
                   [chat_body(s, response_format=fmt_schema) for s in SEEDS]
                   + [chat_body(s, response_format={"type": "json_object"}) for s in SEEDS])
    reasons = {"stop": "eos_token", "length": "length"}
    results = [(reasons[o["choices"][0]["finish_reason"]], o["choices"][0]["message"]["content"])
               for o in out]
    assert_ended_outputs_valid(results[:len(SEEDS)], lambda t: validates(schema, t))
    assert_ended_outputs_valid(results[len(SEEDS):],
                               lambda t: validates({"type": "object"}, t))


def test_completions_response_format(url: str) -> None:
    schema = SCHEMAS["any_of"]
    out = ok(post(url, "/v1/completions", {
        "prompt": ["JSON:", "More JSON:"], "max_tokens": MAX_NEW, "seed": 1, "temperature": 1.0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "v", "schema": schema}}}))
    results = [("eos_token" if c["finish_reason"] == "stop" else c["finish_reason"], c["text"])
               for c in out["choices"]]
    assert_ended_outputs_valid(results, lambda t: validates(schema, t))


# ---- tools -------------------------------------------------------------------------------------


def assert_tool_calls_valid(message: dict[str, Any], allowed: set[str]) -> None:
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    name = call["function"]["name"]
    assert name in allowed
    jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS[name])


@pytest.mark.parametrize(("choice", "allowed"), [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
    ("get_weather", {"get_weather"}),
])
def test_tool_calls_follow_their_schemas(url: str, choice: Any, allowed: set[str]) -> None:
    out = post_all(url, "/v1/chat/completions",
                   [chat_body(s, tools=TOOLS, tool_choice=choice) for s in SEEDS])
    finished = [o["choices"][0] for o in out if o["choices"][0]["finish_reason"] != "length"]
    assert len(finished) * 2 >= len(out)
    for choice_out in finished:
        assert choice_out["finish_reason"] == "tool_calls"
        assert choice_out["message"]["content"] is None
        assert_tool_calls_valid(choice_out["message"], allowed)


def test_tool_choice_auto_calls_a_tool_or_answers(url: str) -> None:
    out = post_all(url, "/v1/chat/completions", [chat_body(s, tools=TOOLS) for s in range(8)])
    finished = [o["choices"][0] for o in out if o["choices"][0]["finish_reason"] != "length"]
    assert len(finished) * 2 >= len(out)
    for c in finished:
        if c["finish_reason"] == "tool_calls":
            assert_tool_calls_valid(c["message"], {"get_weather", "get_time"})
        else:  # no_tool: its content is the answer
            assert c["finish_reason"] == "stop" and isinstance(c["message"]["content"], str)
            assert "tool_calls" not in c["message"]


def test_no_tool_answers_stream_as_content(url: str) -> None:
    """Under "auto" the model sometimes picks no_tool: its content is the answer, streamed as
    content deltas equal to the unstreamed message (cut by max_tokens or not)."""
    bodies = [chat_body(s, tools=TOOLS) for s in range(16)]
    whole = post_all(url, "/v1/chat/completions", bodies)
    answered = [(b, o["choices"][0]) for b, o in zip(bodies, whole, strict=True)
                if "tool_calls" not in o["choices"][0]["message"]]
    assert answered, "no seed picked no_tool"
    for body, choice in answered:
        chunks = stream_chat(url, body)
        assert not any(c["delta"].get("tool_calls") for c in chunks)
        assert "".join(c["delta"].get("content") or "" for c in chunks) == choice["message"][
            "content"]
        assert chunks[-1]["finish_reason"] == choice["finish_reason"] in ("stop", "length")


def test_tool_choice_none_is_a_plain_chat(url: str) -> None:
    body = chat_body(0, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=12)
    plain = ok(post(url, "/v1/chat/completions", {**body, "tools": None}))
    out = ok(post(url, "/v1/chat/completions", body))
    assert out["choices"][0]["message"] == plain["choices"][0]["message"]
    assert out["usage"] == plain["usage"]


def stream_chat(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        events = list(sse_events(r))
    assert events[-1] == "[DONE]"
    return [e["choices"][0] for e in events[:-1] if e["choices"]]


def test_streamed_tool_calls_accumulate_to_valid_calls(url: str) -> None:
    def one(seed: int) -> list[dict[str, Any]]:
        return stream_chat(url, chat_body(seed, tools=TOOLS, tool_choice="required"))

    ended = 0
    for chunks in concurrently(one, SEEDS):
        calls = [c["delta"]["tool_calls"][0] for c in chunks if c["delta"].get("tool_calls")]
        first, rest = calls[0], calls[1:]
        assert first["id"].startswith("call_") and first["type"] == "function"
        assert first["function"]["arguments"] == ""
        assert all("id" not in t and "name" not in t["function"] for t in rest)
        reason = chunks[-1]["finish_reason"]
        if reason == "length":
            continue
        ended += 1
        assert reason == "tool_calls"
        arguments = json.loads("".join(t["function"]["arguments"] for t in rest))
        jsonschema.validate(arguments, PARAMETERS[first["function"]["name"]])
    assert ended * 2 >= len(SEEDS)


def test_streamed_and_unstreamed_tool_calls_agree(url: str) -> None:
    body = chat_body(3, tools=TOOLS, tool_choice="get_weather")
    whole = ok(post(url, "/v1/chat/completions", body))["choices"][0]
    chunks = stream_chat(url, body)
    args = "".join(c["delta"]["tool_calls"][0]["function"]["arguments"]
                   for c in chunks if c["delta"].get("tool_calls"))
    assert chunks[-1]["finish_reason"] == whole["finish_reason"]
    if whole["finish_reason"] == "tool_calls":
        assert json.loads(args) == json.loads(whole["message"]["tool_calls"][0]["function"][
            "arguments"])


# ---- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "body", "error_type", "message"), [
    ("/generate", {"inputs": "x", "parameters": {"grammar": {"type": "regex", "value": "("}}},
     "validation", "Input validation error: grammar is not valid: invalid regex '(': unclosed group"),
    ("/generate_stream", {"inputs": "x", "parameters": {"grammar": {
        "type": "json", "value": {"type": "object", "properties": {"a": {"type": "strng"}}}}}},
     "validation", "Input validation error: grammar is not valid: Invalid type: strng"),
    ("/generate", {"inputs": "x", "parameters": {"grammar": {
        "type": "json", "value": {"not": {"type": "string"}}}}},
     "validation", 'grammar is not valid: unsupported JSON Schema feature: Unimplemented keys: '
                   '["not"]'),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                       "minProperties": "a"}}}},
     "validation", "grammar is not valid"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS,
                              "response_format": {"type": "json_object"}},
     "tool_error", "Tool error: Grammar and tools are mutually exclusive"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "nope"},
     "tool_error", "Tool error: Tool with name nope not found"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "regex", "value": "a{2,"}},
     "validation", "grammar is not valid: invalid regex"),
])
def test_bad_grammars_are_422_before_any_shard(
    url: str, path: str, body: dict[str, Any], error_type: str, message: str
) -> None:
    for stream in (False, True):
        r = post(url, path, {**body, "stream": True} if stream and path.startswith("/v1") else body)
        assert r.status_code == 422, r.text
        err = r.json()
        assert err["error_type"] == error_type and message in err["error"], err


def test_disable_grammar_support_and_a_template_without_tools(model: Path) -> None:
    """--disable-grammar-support: every grammar, response_format and tool call is refused with
    TGI's message (tool_choice "none" still chats). The tiny model's own template does not
    render `tools`: the tools' JSON and TGI's tool prompt go after the last message."""
    with start_shards(model) as shards, RouterProcess(
            shards.urls[0], model, "--disable-grammar-support") as router:
        for path, body in [
            ("/generate", {"inputs": "x", "parameters": {"grammar": {"type": "regex", "value": "a"}}}),
            ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {
                "type": "json_object"}}),
            ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"function": {"name": "f"}}],
                                      "tool_choice": "required", "tool_prompt": ""}),
        ]:
            r = post(router.url, path, body)
            assert r.status_code == 422, r.text
            assert r.json() == {"error": "Input validation error: grammar is not supported",
                                "error_type": "validation"}
        ok(post(router.url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2,
                                                     "tools": TOOLS, "tool_choice": "none"}))
        # A small tool and prompt: /chat_tokenize is bounded by --max-input-tokens (255 here)
        # like a prompt, and TGI's default tool prompt alone is long in this vocabulary.
        tools = [{"type": "function", "function": {"name": "f"}}]
        text = ok(post(router.url, "/chat_tokenize", {
            "messages": [{"role": "user", "content": "Hi"}], "tools": tools,
            "tool_choice": "required", "tool_prompt": "Call:"}))["templated_text"]
        rendered = [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {}}}}]
        assert f"Hi\n---\n{json.dumps(rendered)}\nCall:</s>" in text

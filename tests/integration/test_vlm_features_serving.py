"""The request features of the HTTP API with images (issue 28, point 5), through a real router
and shard of the tiny Qwen2-VL, one server for every request: /v1/chat/completions with a data:
image and a json_schema response_format (valid JSON), tools (tool_choice required: a parsed
call whose arguments are the tool's JSON), `stop` (the greedy text cut where the stop string
first appears), logprobs with top_logprobs (the chosen ones transformers' own), streaming (one
event per token, the text of the non-streamed answer); TGI's /generate with a markdown image,
details, decoder_input_details and top_n_tokens (transformers' tokens), /generate_stream under a
regex; and image requests (greedy, seeded, under a regex) preempted under a small KV budget
ending with the texts they get alone. Prefill chunks are small: every prompt crosses its image
in several."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import numpy as np
import pytest

from tests.integration.http_helpers import metric, sse_events
from tests.integration.test_qwen2_vl_serving import expected
from tests.integration.vlm_serving import MAX_NEW, png
from tests.router_process import RouterProcess
from tests.shard_process import start_shards
from tests.unit.router.http.media.images import data_uri
from tests.vision_models import write_qwen2_vl_model

TOL = 1e-3
# KV for 32 blocks of 16 tokens: one request at a time fits, the preemption test's four
# concurrent ones (~15 + 120 tokens each) do not. Prefill chunks of at most 24 tokens: every
# chat prompt (~60 tokens) is prefilled in chunks that cross its image.
BUDGET = 512
SCHEMA = {"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer", "minimum": 0,
                                                       "maximum": 9}},
    "required": ["color", "n"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "count", "description": "Count", "parameters": {
    "type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"]}}}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    model = write_qwen2_vl_model(tmp_path_factory.mktemp("qwen2_vl"))
    with start_shards(model) as shards, RouterProcess(
        shards.urls[0], model, "--max-total-tokens", "512", "--max-input-tokens", "400",
        "--max-batch-total-tokens", str(BUDGET), "--max-batch-prefill-tokens", "24",
    ) as router:
        yield router.url, model


@pytest.fixture
def url(served: tuple[str, Path]) -> str:
    return served[0]


def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{url}{path}", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return dict(r.json())


def chat_body(image: int, text: str = "what is this", **extra: Any) -> dict[str, Any]:
    """A user message with the image png(image) and `text`, greedy unless `extra` says."""
    return {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_uri(png(image))}},
        {"type": "text", "text": text}]}], "temperature": 0, **extra}


# Seeded (the greedy text of this random model repeats itself early), past EOS.
LONG: dict[str, Any] = {"max_tokens": 24, "temperature": 1.0, "seed": 3, "ignore_eos": True}


def test_json_schema_response_format_gives_valid_json(url: str) -> None:
    for seed in (1, 2):
        body = chat_body(seed, max_tokens=60, response_format={
            "type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}})
        choice = post(url, "/v1/chat/completions", body)["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_a_required_tool_call_is_parsed(url: str) -> None:
    body = chat_body(3, max_tokens=80, tools=[TOOL], tool_choice="required", tool_prompt="")
    choice = post(url, "/v1/chat/completions", body)["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "count"
    jsonschema.validate(json.loads(call["function"]["arguments"]),
                        TOOL["function"]["parameters"])  # type: ignore[index]


def test_a_stop_string_cuts_the_text(url: str) -> None:
    free = post(url, "/v1/chat/completions", chat_body(4, **LONG))["choices"][0]
    text = free["message"]["content"]
    # A two-character string first seen late in the answer: the request must end there.
    at = next(i for i in range(4, len(text) - 1) if text[i:i + 2] not in text[:i + 1]
              and "\ufffd" not in text[i:i + 2])
    stop = text[at:at + 2]
    stopped = post(url, "/v1/chat/completions", chat_body(4, **LONG, stop=[stop]))
    choice, k = stopped["choices"][0], stopped["usage"]["completion_tokens"]
    assert choice["finish_reason"] == "stop"
    # It ends with the token that completes the stop string (TGI keeps that token's text):
    # the same request cut by max_tokens there gives the same text, one token less no stop.
    cut = {n: post(url, "/v1/chat/completions", chat_body(4, **{**LONG, "max_tokens": n})
                   )["choices"][0]["message"]["content"] for n in (k - 1, k)}
    assert choice["message"]["content"] == cut[k] and text.startswith(cut[k].rstrip("\ufffd"))
    assert cut[k].find(stop) == at and stop not in cut[k - 1]


def test_logprobs_and_top_logprobs_are_transformers(served: tuple[str, Path]) -> None:
    url, model = served
    body = chat_body(5, max_tokens=MAX_NEW, logprobs=True, top_logprobs=3)
    ids = [t["id"] for t in post(url, "/chat_tokenize", body)["tokenize_response"]]
    _, want = expected(model, ids, png(5))
    content = post(url, "/v1/chat/completions", body)["choices"][0]["logprobs"]["content"]
    assert len(content) >= 1
    np.testing.assert_allclose([t["logprob"] for t in content], want[:len(content)],
                               rtol=TOL, atol=TOL)
    for t in content:
        top = [x["logprob"] for x in t["top_logprobs"]]
        assert len(top) == 3 and top == sorted(top, reverse=True)
        assert abs(top[0] - t["logprob"]) < 1e-5  # greedy: the chosen token is the first


def test_streaming_sends_one_event_per_token_and_the_whole_text(url: str) -> None:
    body = chat_body(6, max_tokens=12, logprobs=True)
    whole = post(url, "/v1/chat/completions", body)
    answer = whole["choices"][0]["message"]["content"]
    tokens = whole["usage"]["completion_tokens"]
    pieces: list[str] = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True},
                      timeout=300) as r:
        assert r.status_code == 200
        events = [e for e in sse_events(r) if e != "[DONE]"]
    token_events = [e for e in events if e["choices"] and e["choices"][0].get("logprobs")]
    assert len(token_events) == tokens
    pieces = [e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]]
    text = "".join(pieces)
    # A stream holds back a last token ending inside a UTF-8 character (byte tokens).
    assert answer.startswith(text) and set(answer[len(text):]) <= {"\ufffd"}


def test_generate_with_details_and_top_tokens(served: tuple[str, Path]) -> None:
    url, model = served
    image = png(7)
    out = post(url, "/generate", {"inputs": f"look at ![]({data_uri(image)}) and say",
                                  "parameters": {"max_new_tokens": MAX_NEW, "details": True,
                                                 "decoder_input_details": True,
                                                 "top_n_tokens": 2}})
    details = out["details"]
    ids = [t["id"] for t in details["prefill"]]
    tokens, logprobs = expected(model, ids, image)  # transformers' first MAX_NEW tokens
    got = details["tokens"]
    assert [t["id"] for t in got] == tokens[:len(got)] and len(got) >= 1
    np.testing.assert_allclose([t["logprob"] for t in got], logprobs[:len(got)],
                               rtol=TOL, atol=TOL)
    assert len(details["top_tokens"]) == len(got)
    for step, t in zip(details["top_tokens"], got, strict=True):
        assert len(step) == 2 and step[0]["id"] == t["id"]
        assert step[0]["logprob"] >= step[1]["logprob"]


# The preempted requests' parameters: greedy, seeded sampling, and a regex long enough to be
# cut by a preemption (its grammar state must resume with the generated tokens).
LONG_PARAMS: list[dict[str, Any]] = [
    {}, {"do_sample": True, "seed": 7, "temperature": 1.0}, {},
    {"grammar": {"type": "regex", "value": "([a-z]{3} ){30}"}},
]


def generate_long(url: str, k: int) -> str:
    body = {"inputs": f"see ![]({data_uri(png(20 + k))}) then",
            "parameters": {"max_new_tokens": 120, "ignore_eos": True, "details": True,
                           **LONG_PARAMS[k]}}
    out = post(url, "/generate", body)
    if "grammar" in LONG_PARAMS[k]:
        assert re.fullmatch(LONG_PARAMS[k]["grammar"]["value"], out["generated_text"])
    else:
        assert out["details"]["generated_tokens"] == 120
    return str(out["generated_text"])


def test_image_requests_preempted_end_with_their_unpreempted_text(url: str) -> None:
    alone = [generate_long(url, seed) for seed in range(4)]
    assert len(set(alone)) == 4
    before = metric(url, "pytgi_preemptions_total")
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda s: generate_long(url, s), range(4)))
    assert metric(url, "pytgi_preemptions_total") > before
    assert together == alone


def test_generate_stream_under_a_grammar_gives_the_generate_text(url: str) -> None:
    """TGI's /generate_stream with a markdown image and a regex: one event per token, their
    texts the final text, which /generate gives too and the regex matches."""
    regex = "[0-9]{2}-(yes|no)"
    body = {"inputs": f"look ![]({data_uri(png(8))}) and",
            "parameters": {"max_new_tokens": 20, "grammar": {"type": "regex", "value": regex}}}
    whole = post(url, "/generate", {**body, "parameters": {**body["parameters"],
                                                          "details": True}})
    assert re.fullmatch(regex, whole["generated_text"])
    with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=300) as r:
        assert r.status_code == 200
        events = list(sse_events(r))
    assert len(events) == whole["details"]["generated_tokens"]
    assert "".join(e["token"]["text"] for e in events if not e["token"]["special"]) == \
        whole["generated_text"] == events[-1]["generated_text"]

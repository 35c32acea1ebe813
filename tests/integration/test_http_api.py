"""TGI's HTTP API end to end: a real pytgi-router process in front of a real shard process on the
tiny Llama. Responses, streams, continuous batching, every bad input, disconnects, metrics."""

from __future__ import annotations

import asyncio
import json
import math
import re
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest

from tests.frozen_process import frozen
from tests.integration.http_helpers import metric, sse_events
from tests.router_process import RouterProcess
from tests.shard_process import ShardProcesses, start_shards

GREEDY = {"max_new_tokens": 12}


@pytest.fixture(scope="module")
def url(shards: ShardProcesses, model: Path) -> Iterator[str]:
    # 8 steps a call at most: the interleaving test counts a stream's bursts (one per call).
    with RouterProcess(shards.urls[0], model, "--max-input-tokens", "100",
                       "--max-total-tokens", "200", "--max-decode-steps", "8") as router:
        yield router.url


def post(url: str, path: str, body: Any, **kw: Any) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60, **kw)


def generate(url: str, inputs: str, **params: Any) -> dict[str, Any]:
    r = post(url, "/generate", {"inputs": inputs, "parameters": params})
    assert r.status_code == 200, r.text
    return r.json()


def stream(url: str, inputs: str, **params: Any) -> list[Any]:
    with httpx.stream("POST", f"{url}/generate_stream", timeout=60,
                      json={"inputs": inputs, "parameters": params}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-accel-buffering"] == "no"
        return list(sse_events(r))


# ---- the happy paths ---------------------------------------------------------------------------


def test_health_info_models_docs(url: str) -> None:
    for path in ("/health", "/ping", "/"):
        r = httpx.get(f"{url}{path}")
        assert r.status_code == 200 and r.content == b""
    info = httpx.get(f"{url}/info").json()
    assert info["max_input_tokens"] == 100 and info["max_total_tokens"] == 200
    assert info["max_best_of"] == 2 and info["router"] == "text-generation-router"
    assert info["model_device_type"] == "cpu" and info["model_id"].endswith("llama")
    models = httpx.get(f"{url}/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == info["model_id"]
    doc = httpx.get(f"{url}/api-doc/openapi.json").json()
    assert doc["openapi"].startswith("3.") and "/generate_stream" in doc["paths"]
    assert httpx.get(f"{url}/openapi.json").json() == doc
    assert "swagger-ui" in httpx.get(f"{url}/docs").text


def test_top_n_tokens_under_ties_list_exactly_n(url: str) -> None:
    """temperature 1e9 ties every token: n entries, lowest ids first, not the vocabulary."""
    flat = {"max_new_tokens": 3, "temperature": 1e9, "seed": 1, "details": True}
    d = generate(url, "Hello", **flat, top_n_tokens=2)["details"]
    assert [[t["id"] for t in step] for step in d["top_tokens"]] == [[0, 1]] * 3
    chat = post(url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3, "seed": 1,
        "temperature": 1e9, "logprobs": True, "top_logprobs": 2})
    assert chat.status_code == 200, chat.text
    content = chat.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(c["top_logprobs"]) == 2 for c in content)

def test_a_temperature_below_the_threshold_is_greedy_over_http(url: str) -> None:
    """1e-50 used to sample at temperature 1 (0 on the wire reads as unset), 1e-40 to give NaN
    logprobs: both are greedy now, with finite logprobs."""
    greedy = generate(url, "Hello", max_new_tokens=8, details=True)["details"]["tokens"]
    for temperature in (1e-50, 1e-40):
        tokens = generate(url, "Hello", max_new_tokens=8, details=True, seed=3,
                          temperature=temperature)["details"]["tokens"]
        assert [t["id"] for t in tokens] == [t["id"] for t in greedy], temperature
        assert all(math.isfinite(t["logprob"]) for t in tokens), temperature


def test_generate_details_headers_and_full_text(url: str) -> None:
    r = post(url, "/generate", {"inputs": "Hello world", "parameters": {
        **GREEDY, "details": True, "decoder_input_details": True, "top_n_tokens": 2}})
    assert r.status_code == 200
    body = r.json()
    d = body["details"]
    assert d["generated_tokens"] == len(d["tokens"]) <= 12 and d["seed"] is None
    assert d["finish_reason"] in ("length", "eos_token")
    assert d["prefill"][0]["logprob"] is None and len(d["prefill"]) >= 2
    assert all(len(step) == 2 for step in d["top_tokens"])
    h = r.headers
    assert h["x-prompt-tokens"] == str(len(d["prefill"]))
    assert h["x-generated-tokens"] == str(d["generated_tokens"])
    assert h["x-compute-characters"] == str(len("Hello world"))
    for key in ("x-compute-time", "x-total-time", "x-validation-time", "x-queue-time",
                "x-inference-time", "x-time-per-token", "x-compute-type"):
        assert key in h
    full = generate(url, "Hello world", **GREEDY, return_full_text=True)
    assert full["generated_text"] == "Hello world" + body["generated_text"]
    assert "details" not in generate(url, "Hello world", **GREEDY)


def test_stream_equals_generate_and_ends_with_details(url: str) -> None:
    events = stream(url, "The quick brown fox", **GREEDY, details=True)
    whole = generate(url, "The quick brown fox", **GREEDY, details=True)
    assert [e["index"] for e in events] == list(range(1, len(events) + 1))
    assert [e["token"]["id"] for e in events] == [t["id"] for t in whole["details"]["tokens"]]
    assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
    last = events[-1]
    assert last["generated_text"] == whole["generated_text"]
    assert last["details"]["generated_tokens"] == len(events)
    assert last["details"]["input_length"] == int(
        post(url, "/generate", {"inputs": "The quick brown fox", "parameters": GREEDY})
        .headers["x-prompt-tokens"])


def test_sampling_seed_is_reported_and_reproducible(url: str) -> None:
    a = generate(url, "Hello", max_new_tokens=8, do_sample=True, seed=5, details=True)
    b = generate(url, "Hello", max_new_tokens=8, do_sample=True, seed=5, details=True)
    assert a["details"]["seed"] == 5 and a["generated_text"] == b["generated_text"]
    unseeded = generate(url, "Hello", max_new_tokens=2, do_sample=True, details=True)
    assert isinstance(unseeded["details"]["seed"], int)


def test_best_of_returns_the_best_and_the_others(url: str) -> None:
    body = generate(url, "Hello", max_new_tokens=6, best_of=2, do_sample=True, details=True)
    d = body["details"]
    assert len(d["best_of_sequences"]) == 1

    def mean(tokens: list[dict[str, Any]]) -> float:
        return sum(t["logprob"] for t in tokens) / len(tokens)

    assert mean(d["tokens"]) >= mean(d["best_of_sequences"][0]["tokens"])


def test_stop_sequence_and_compat_route(url: str) -> None:
    whole = generate(url, "Hello world", **GREEDY, details=True)
    free = whole["generated_text"]
    # A stop sequence: a plain-text token of the output that does not occur before it.
    texts = [t["text"] for t in whole["details"]["tokens"]]
    stop = next(t for i, t in enumerate(texts[1:-1], 1)
                if t.strip().isalnum() and t.isascii() and t not in "".join(texts[:i]))
    stopped = generate(url, "Hello world", **GREEDY, stop=[stop], details=True)
    assert stopped["generated_text"].endswith(stop)
    assert stopped["details"]["finish_reason"] == "stop_sequence"
    assert free.startswith(stopped["generated_text"])
    compat = post(url, "/", {"inputs": "Hello world", "parameters": GREEDY})
    assert compat.json() == [{"generated_text": "Hello world" + free}]
    with httpx.stream("POST", f"{url}/", json={"inputs": "Hello world", "stream": True,
                                               "parameters": GREEDY}) as r:
        events = list(sse_events(r))
    assert events[-1]["generated_text"] == "Hello world" + free


def test_tokenize_and_invocations(url: str) -> None:
    toks = post(url, "/tokenize", {"inputs": "Hé world"}).json()
    assert toks[0] == {"id": 0, "text": "", "start": 0, "stop": 0}  # BOS
    assert "".join(t["text"] for t in toks) == "Hé world"
    assert toks[-1]["stop"] == len("Hé world".encode())  # byte offsets, as TGI
    cut = post(url, "/tokenize", {"inputs": "Hé world", "parameters": {"truncate": 2}}).json()
    assert cut == toks[-2:]
    gen = post(url, "/invocations", {"inputs": "Hi", "parameters": {"max_new_tokens": 2}})
    assert isinstance(gen.json(), list)
    chat = post(url, "/invocations", {"messages": [{"role": "user", "content": "Hi"}],
                                      "max_tokens": 2})
    assert chat.json()["object"] == "chat.completion"
    comp = post(url, "/invocations", {"prompt": "Hi", "max_tokens": 2})
    assert comp.json()["object"] == "text_completion"
    templated = post(url, "/chat_tokenize", {"messages": [{"role": "user", "content": "Hi"}]})
    assert templated.json()["templated_text"] == "<s><|user|>\nHi</s>\n<|assistant|>\n"


def test_openai_streams_over_http(url: str) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": True,
            "temperature": 0, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        events = list(sse_events(r))
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    assert events[-2]["usage"]["completion_tokens"] == len(events) - 2
    plain = post(url, "/v1/chat/completions", {**body, "stream": False}).json()
    streamed = "".join(e["choices"][0]["delta"]["content"] for e in events[:-2])
    # The stream withholds a trailing incomplete UTF-8 sequence that the final text shows as
    # U+FFFD (TGI does the same); the random tiny model produces such bytes.
    assert plain["choices"][0]["message"]["content"].rstrip("\ufffd") == streamed
    comp = {"prompt": ["Hi", "Bye"], "max_tokens": 4, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=comp) as r:
        cevents = list(sse_events(r))
    assert cevents[-1] == "[DONE]"
    by_index: dict[int, str] = {0: "", 1: ""}
    for e in cevents[:-1]:
        by_index[e["choices"][0]["index"]] += e["choices"][0]["text"]
    whole = post(url, "/v1/completions", {**comp, "stream": False}).json()
    assert [c["text"].rstrip("\ufffd") for c in whole["choices"]] == [by_index[0], by_index[1]]


# ---- continuous batching -----------------------------------------------------------------------


def admitted(url: str) -> int:
    """Requests the router holds, queued or running (SGLang's /get_load, which counts both)."""
    return int(httpx.get(f"{url}/get_load", timeout=10).json()[0]["num_reqs"])


def test_concurrent_streams_interleave_and_match_solo_runs(
    url: str, shards: ShardProcesses
) -> None:
    """16 streams started while the shard is frozen are all queued before any step runs, so
    they decode together however slowly a loaded machine starts them (started freely, a busy
    client could open them one after another)."""
    prompts = [f"Request number {i}: the quick brown fox" for i in range(16)]
    solo = [[t["id"] for t in generate(url, p, max_new_tokens=16, details=True)
             ["details"]["tokens"]] for p in prompts]
    arrivals: list[int] = []

    async def one(client: httpx.AsyncClient, i: int) -> list[int]:
        ids = []
        body = {"inputs": prompts[i], "parameters": {"max_new_tokens": 16}}
        async with client.stream("POST", f"{url}/generate_stream", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    ids.append(json.loads(line[5:])["token"]["id"])
                    arrivals.append(i)
        return ids

    async def main() -> list[list[int]]:
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            with frozen(shards.procs[0].pid):
                tasks = [asyncio.create_task(one(client, i)) for i in range(16)]
                # Every stream admitted: queued, or in the first prefill (which may hold
                # several) waiting on the frozen shard.
                while admitted(url) < len(prompts):
                    await asyncio.sleep(0.05)
            return list(await asyncio.gather(*tasks))

    together = asyncio.run(main())
    assert together == solo
    # Interleaved: the arrival order switches request far more often than 16 back-to-back runs
    # (15 switches). A multi-step call delivers each stream's tokens in bursts of up to
    # --max-decode-steps (8 here): 16 tokens in ~3 bursts per stream, ~48 switches.
    switches = sum(a != b for a, b in zip(arrivals, arrivals[1:], strict=False))
    assert switches > 2 * len(prompts)


# ---- bad inputs --------------------------------------------------------------------------------

BAD_GENERATE: list[tuple[dict[str, Any], str]] = [
    ({"inputs": "x", "parameters": {"temperature": 0}}, "`temperature` must be strictly positive"),
    ({"inputs": "x", "parameters": {"top_p": 0}}, "`top_p` must be > 0.0 and <= 1.0"),
    ({"inputs": "x", "parameters": {"top_k": 0}}, "`top_k` must be strictly positive"),
    ({"inputs": "x", "parameters": {"typical_p": 1}}, "`typical_p` must be > 0.0 and < 1.0"),
    ({"inputs": "x", "parameters": {"repetition_penalty": 0}},
     "`repetition_penalty` must be strictly positive"),
    ({"inputs": "x", "parameters": {"frequency_penalty": 3}},
     "`frequency_penalty` must be >= -2.0 and <= 2.0"),
    ({"inputs": "x", "parameters": {"max_new_tokens": 0}},
     "`max_new_tokens` must be strictly positive"),
    ({"inputs": "x", "parameters": {"stop": ["a"] * 5}},
     "`stop` supports up to 4 stop sequences. Given: 5"),
    ({"inputs": "x", "parameters": {"stop": ["x" * 100_000]}},
     "`stop` sequences must be at most 512 characters long. Given: 100000"),
    ({"inputs": "x", "parameters": {"top_n_tokens": 6}},
     "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
    ({"inputs": "x", "parameters": {"best_of": 3, "do_sample": True}},
     "`best_of` must be > 0 and <= 2. Given: 3"),
    ({"inputs": "x", "parameters": {"best_of": 2}}, "you must use sampling when `best_of` is > 1"),
    ({"inputs": "x", "parameters": {"best_of": 2, "do_sample": True, "seed": 3}},
     "`seed` must not be set when `best_of` > 1"),
    ({"inputs": "x", "parameters": {"truncate": 0}},
     "`truncate` must be strictly positive and less than 100. Given: 0"),
    ({"inputs": ""}, "`inputs` cannot be empty"),
    ({"inputs": "hello " * 150, "parameters": {"max_new_tokens": 1}},
     "`inputs` tokens + `max_new_tokens` must be <= 200."),
    ({"inputs": "x", "parameters": {"max_new_tokens": 300}},
     "`inputs` tokens + `max_new_tokens` must be <= 200."),
    ({"inputs": "x", "parameters": {"grammar": {"type": "regex", "value": "a{2,"}}},
     "grammar is not valid: invalid regex 'a{2,': unclosed counted repetition"),
    ({}, "missing field `inputs`"),
    ({"inputs": ["x"]}, "`inputs` must be a string"),
    ({"inputs": "x", "parameters": {"seed": -1}}, "`parameters.seed` must be an integer"),
]


@pytest.mark.parametrize(("body", "message"), BAD_GENERATE)
def test_bad_generate_inputs_are_422(url: str, body: dict[str, Any], message: str) -> None:
    for path in ("/generate", "/generate_stream"):
        r = post(url, path, body)
        assert r.status_code == 422, (path, r.text)
        assert r.headers["content-type"].startswith("application/json")
        err = r.json()
        assert err["error_type"] == "validation"
        assert err["error"].startswith("Input validation error: ")
        streaming_best_of = path == "/generate_stream" and "best_of" in body.get("parameters", {})
        assert (message if not streaming_best_of else "`best_of`") in err["error"]


def test_stream_only_errors_come_before_the_stream(url: str) -> None:
    for params, msg in ((({"best_of": 2, "do_sample": True}),
                         "`best_of` != 1 is not supported when streaming tokens"),
                        ({"decoder_input_details": True},
                         "`decoder_input_details` == true is not supported when streaming")):
        r = post(url, "/generate_stream", {"inputs": "x", "parameters": params})
        assert r.status_code == 422 and msg in r.json()["error"]


def test_http_level_errors_in_json(url: str) -> None:
    def check(r: httpx.Response, status: int, error_type: str) -> None:
        assert r.status_code == status, r.text
        assert r.json()["error_type"] == error_type and r.json()["error"]

    check(httpx.post(f"{url}/generate", content=b"{not json"), 400, "invalid_request")
    check(httpx.post(f"{url}/generate", content=b'{"inputs": "\xff"}'), 400, "invalid_request")
    check(httpx.post(f"{url}/generate", content=b'{"inputs": NaN}'), 400, "invalid_request")
    check(httpx.get(f"{url}/nowhere"), 404, "not_found")
    check(httpx.get(f"{url}/generate"), 405, "method_not_allowed")
    big = b'{"inputs": "' + b"a" * 2_000_001 + b'"}'
    check(httpx.post(f"{url}/generate", content=big), 413, "payload_too_large")

    def chunked() -> Iterator[bytes]:
        yield b'{"inputs": "'
        for _ in range(21):
            yield b"a" * 100_000
        yield b'"}'

    check(httpx.post(f"{url}/generate", content=chunked()), 413, "payload_too_large")
    tools = {"messages": [{"role": "user", "content": "x"}],
             "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
             "tool_choice": "g"}
    check(post(url, "/v1/chat/completions", tools), 422, "tool_error")
    check(post(url, "/v1/chat/completions", {"messages": []}), 422, "validation")
    check(post(url, "/v1/completions", {"prompt": "x", "suffix": "y"}), 422,
          "suffix not supported")
    check(post(url, "/v1/completions", {"prompt": ["x"] * 5}), 422, "batch size exceeded")
    check(post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                             "temperature": -1, "stream": True}), 422, "validation")
    # ... and the server still serves.
    assert generate(url, "Hello", max_new_tokens=2)["generated_text"] is not None


# ---- disconnects and metrics -------------------------------------------------------------------


def _wait_for(pred: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_disconnects_cancel_and_free_the_kv_blocks(url: str, shards: ShardProcesses) -> None:
    """A client that leaves mid-request is counted as dropped and its request leaves the batch
    with its KV blocks. The shard is frozen while the client leaves, so the request cannot have
    finished first, however fast the tiny model generates its 180 tokens."""
    dropped = metric(url, "tgi_request_failure", err="dropped")
    total_blocks = metric(url, "pytgi_kv_blocks_total")
    body = {"inputs": "Hello world", "parameters": {"max_new_tokens": 180}}
    shard = shards.procs[0].pid
    with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=60) as r:
        events = sse_events(r)
        next(events)
        next(events)
        with frozen(shard):
            r.close()  # a stream two tokens in, its next step held by the frozen shard
            _wait_for(lambda: metric(url, "tgi_request_failure", err="dropped") == dropped + 1)
    _wait_for(lambda: metric(url, "pytgi_kv_blocks_free") == total_blocks)
    # The non-streaming route notices a disconnect too.
    prefills = metric(url, "tgi_batch_inference_count", method="prefill")
    host = urlparse(url)
    raw = json.dumps(body).encode()
    with frozen(shard):
        with socket.create_connection((host.hostname, host.port)) as s:
            s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw)
            # Closed once its prefill is on the (frozen) shard: KV blocks held, no token yet.
            _wait_for(lambda: metric(url, "tgi_batch_inference_count", method="prefill")
                      == prefills + 1)
        _wait_for(lambda: metric(url, "tgi_request_failure", err="dropped") == dropped + 2)
    _wait_for(lambda: metric(url, "pytgi_kv_blocks_free") == total_blocks)
    assert metric(url, "tgi_batch_current_size") == 0


def test_metrics_count_requests(url: str) -> None:
    before = {k: metric(url, k) for k in ("tgi_request_count", "tgi_request_success")}
    failures = metric(url, "tgi_request_failure", err="validation")
    generate(url, "Hi", max_new_tokens=3)
    post(url, "/generate", {"inputs": "x", "parameters": {"top_k": 0}})
    assert metric(url, "tgi_request_count") == before["tgi_request_count"] + 2
    assert metric(url, "tgi_request_success") == before["tgi_request_success"] + 1
    assert metric(url, "tgi_request_failure", err="validation") == failures + 1
    assert metric(url, "tgi_request_generated_tokens_count") >= 1
    assert metric(url, "tgi_request_duration_count") >= 1
    assert metric(url, "tgi_request_inference_duration_count") >= 1
    assert metric(url, "tgi_batch_inference_count", method="decode") > 0


# ---- routers with other settings (a shard of their own, one router at a time) ------------------


@pytest.fixture(scope="module")
def spare_shards(model: Path) -> Iterator[ShardProcesses]:
    with start_shards(model) as s:
        yield s


LIMITS = ("max_batch_prefill_tokens", "max_batch_total_tokens", "max_total_tokens",
          "max_input_tokens")


def served_limits(shards: ShardProcesses, model: Path, *flags: str) -> tuple[dict[str, int], str]:
    """/info's four token limits and the router's output, for a router started with `flags`
    (and no others: the prefill budget is measured unless `flags` set it)."""
    with RouterProcess(shards.urls[0], model, *flags, measure_prefill=True) as router:
        info = httpx.get(f"{router.url}/info", timeout=30).json()
        return {k: info[k] for k in LIMITS}, router.output


def test_unset_limits_are_measured_at_warmup_and_flags_win(
    spare_shards: ShardProcesses, model: Path
) -> None:
    """Zero-config sizing: /info serves what the shard measured and sized, the log says why."""
    limits, output = served_limits(spare_shards, model)
    m = re.search(r"max-batch-prefill-tokens (\d+): measured by the shards at Warmup: prefill "
                  r"throughput measured at ([\d/]+) tokens: ([\d/]+) tok/s", output)
    assert m is not None, output
    rungs, rates = [int(t) for t in m[2].split("/")], [float(t) for t in m[3].split("/")]
    assert limits["max_batch_prefill_tokens"] == int(m[1])
    # The smallest rung near the peak of those fast enough for one step (0.5 s).
    fast = [(t, r) for t, r in zip(rungs, rates, strict=True) if t / r <= 0.5] or [
        (rungs[0], rates[0])]
    peak = max(r for _, r in fast)
    assert int(m[1]) == min(t for t, r in fast if r >= 0.9 * peak - 1)
    kv = re.search(r"max-batch-total-tokens (\d+): the shards' KV cache \((\d+) blocks of (\d+)",
                   output)
    assert kv is not None, output
    assert limits["max_batch_total_tokens"] == int(kv[1]) == int(kv[2]) * int(kv[3])
    # The tiny Llama's context (256) is below the KV capacity; a shard that chunks takes a
    # prompt of the whole context whatever the prefill budget.
    assert (limits["max_total_tokens"], limits["max_input_tokens"]) == (256, 255)
    assert "max-total-tokens 256: the model's context" in output
    flags = {"max_batch_prefill_tokens": 48, "max_batch_total_tokens": 1024,
             "max_total_tokens": 200, "max_input_tokens": 100}
    argv = [a for k, v in flags.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    limits, output = served_limits(spare_shards, model, *argv)
    assert limits == flags
    assert "max-batch-prefill-tokens 48: --max-batch-prefill-tokens" in output
    assert "measured by the shards" not in output


def test_api_key(spare_shards: ShardProcesses, model: Path) -> None:
    with RouterProcess(spare_shards.urls[0], model, "--api-key", "sekret") as router:
        u = router.url
        assert httpx.get(f"{u}/health").status_code == 200
        assert httpx.get(f"{u}/metrics").status_code == 200
        r = post(u, "/generate", {"inputs": "x"})
        assert r.status_code == 401 and r.json()["error_type"] == "unauthorized"
        assert post(u, "/generate", {"inputs": "x"},
                    headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(f"{u}/info").status_code == 401
        ok = post(u, "/generate", {"inputs": "x", "parameters": {"max_new_tokens": 1}},
                  headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
    assert "sekret" not in router.output


def test_overload_is_429(spare_shards: ShardProcesses, model: Path) -> None:
    with RouterProcess(spare_shards.urls[0], model, "--max-concurrent-requests", "1") as router:
        u = router.url
        body = {"inputs": "Hello world", "parameters": {"max_new_tokens": 150}}
        # Frozen, the shard cannot finish the stream: it holds the only permit until it closes.
        with frozen(spare_shards.procs[0].pid), \
                httpx.stream("POST", f"{u}/generate_stream", json=body, timeout=60) as r:
            assert r.status_code == 200  # admitted: its permit is taken
            busy = post(u, "/generate", {"inputs": "x"})
            assert busy.status_code == 429
            assert busy.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
            busy_stream = post(u, "/generate_stream", {"inputs": "x"})
            assert busy_stream.status_code == 429
        _wait_for(lambda: post(u, "/generate", {"inputs": "x", "parameters": {
            "max_new_tokens": 1}}).status_code == 200)


def test_sigterm_drains_then_exits_zero(spare_shards: ShardProcesses, model: Path) -> None:
    """SIGTERM: /health and new requests answer 503 while the request in flight finishes, then
    the router exits 0. The shard stays frozen until the router is seen draining, so the long
    request is still in flight then, however fast the model. No grace: admission stops at once
    (the grace period is the next test's)."""
    router = RouterProcess(spare_shards.urls[0], model, "--drain-grace-seconds", "0").start()
    try:
        u = router.url
        body = {"inputs": "Hello world", "parameters": {"max_new_tokens": 190, "details": True}}
        prefills = metric(u, "tgi_batch_inference_count", method="prefill")
        with ThreadPoolExecutor(1) as pool:
            with frozen(spare_shards.procs[0].pid):
                long = pool.submit(post, u, "/generate", body)
                _wait_for(lambda: metric(u, "tgi_batch_inference_count", method="prefill")
                          == prefills + 1)
                router.signal()
                _wait_for(lambda: httpx.get(f"{u}/health").status_code == 503)
                new = post(u, "/generate", {"inputs": "x"})
                assert new.status_code == 503, new.text
            finished = long.result(60)
        assert finished.status_code == 200, finished.text
        assert finished.json()["details"]["generated_tokens"] == 190
        assert router.wait(30) == 0
    finally:
        router.kill()


def test_sigterm_is_not_ready_first_then_drains(spare_shards: ShardProcesses, model: Path) -> None:
    """With --drain-grace-seconds: SIGTERM turns /health 503 (not ready, TGI's error shape) while
    generation is still admitted; only after the grace do new requests get 503; both requests in
    flight (one from before the signal, one admitted during the grace) complete, and the router
    exits 0. The shard stays frozen until then, so that nothing finishes early."""
    grace = 3.0
    router = RouterProcess(spare_shards.urls[0], model, "--drain-grace-seconds", str(grace)).start()
    try:
        u = router.url
        body = {"inputs": "Hello world", "parameters": {"max_new_tokens": 50, "details": True}}
        prefills = metric(u, "tgi_batch_inference_count", method="prefill")
        with ThreadPoolExecutor(2) as pool:
            with frozen(spare_shards.procs[0].pid):
                before = pool.submit(post, u, "/generate", body)
                _wait_for(lambda: metric(u, "tgi_batch_inference_count", method="prefill")
                          == prefills + 1)
                # The gateway's KV gauge sees the admitted request's blocks during its prefill.
                assert 0 < metric(u, "pytgi_kv_cache_usage_ratio") < 1
                router.signal()
                signalled = time.monotonic()
                _wait_for(lambda: httpx.get(f"{u}/health").status_code == 503)
                health = httpx.get(f"{u}/health").json()
                assert health["error_type"] == "unhealthy" and "not ready" in health["error"]
                during = pool.submit(post, u, "/generate", body)
                _wait_for(lambda: metric(u, "tgi_queue_size") == 1)  # admitted, queued
                assert time.monotonic() - signalled < grace, "too slow to check the grace"
                # Not polled with requests: each one sent during the grace would be admitted.
                _wait_for(lambda: "no longer admitting" in router.output)
                assert time.monotonic() - signalled >= grace
                refused = post(u, "/generate", {"inputs": "x"})
                assert refused.json() == {"error": "Server is shutting down",
                                          "error_type": "unhealthy"}
            for finished in (before.result(60), during.result(60)):
                assert finished.status_code == 200, finished.text
                assert finished.json()["details"]["generated_tokens"] == 50
        assert router.wait(30) == 0
    finally:
        router.kill()

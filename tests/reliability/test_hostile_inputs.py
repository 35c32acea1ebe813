"""Hostile and extreme inputs over real HTTP to a real router and shard: each one gets either a
normal answer or a clean 4xx in the error shape, the prompt limits hold to the exact token, and
afterwards the server is healthy with every KV block free and no shard call ever failed."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest

from pytgi_router.http.http_protocol import MAX_HEAD_BYTES
from tests.integration.http_helpers import sse_events
from tests.reliability.router_checks import assert_unharmed, error_body
from tests.router_process import RouterProcess
from tests.shard_process import ShardProcesses

MAX_INPUT, MAX_TOTAL = 100, 200


@pytest.fixture(scope="module")
def router(shard: ShardProcesses, llama: Path) -> Iterator[RouterProcess]:
    with RouterProcess(shard.urls[0], llama, "--max-input-tokens", str(MAX_INPUT),
                       "--max-total-tokens", str(MAX_TOTAL)) as process:
        yield process


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60) as c:
        yield c


def assert_error_shape(r: httpx.Response, status: int) -> dict[str, str]:
    assert r.status_code == status, r.text
    return error_body(r)


def params(**extra: Any) -> dict[str, Any]:
    return {"max_new_tokens": 2, **extra}


def raw(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


# (name, path, raw body, expected status, fragment of the error or of the answer)
CASES: list[tuple[str, str, bytes, int, str]] = [
    ("huge max_new_tokens", "/generate",
     raw({"inputs": "x", "parameters": {"max_new_tokens": 10**9}}), 422, "max_new_tokens"),
    ("max_new_tokens beyond u32", "/generate",
     raw({"inputs": "x", "parameters": {"max_new_tokens": 2**40}}), 422, "max_new_tokens"),
    ("1e309 temperature", "/generate",
     b'{"inputs": "x", "parameters": {"temperature": 1e309}}', 422, "finite"),
    ("-1e309 top_p", "/generate",
     b'{"inputs": "x", "parameters": {"top_p": -1e309}}', 422, "finite"),
    ("NaN literal", "/generate", b'{"inputs": "x", "parameters": {"top_p": NaN}}', 400, "JSON"),
    ("negative top_k", "/generate", raw({"inputs": "x", "parameters": params(top_k=-3)}), 422,
     "top_k"),
    ("negative max_new_tokens", "/generate",
     raw({"inputs": "x", "parameters": {"max_new_tokens": -1}}), 422, "max_new_tokens"),
    ("huge top_k", "/generate", raw({"inputs": "x", "parameters": params(top_k=2**31 - 1,
                                                                        do_sample=True)}), 200, ""),
    ("top_k beyond i32", "/generate", raw({"inputs": "x", "parameters": params(top_k=10**12)}),
     422, "top_k"),
    ("seed 2^64 - 1", "/generate",
     raw({"inputs": "x", "parameters": params(seed=2**64 - 1, do_sample=True)}), 200, ""),
    ("seed 2^64", "/generate", raw({"inputs": "x", "parameters": params(seed=2**64)}), 422,
     "seed"),
    ("tiny temperature", "/generate",
     raw({"inputs": "x", "parameters": params(temperature=1e-300, do_sample=True)}), 200, ""),
    ("huge temperature", "/generate",
     raw({"inputs": "x", "parameters": params(temperature=1e30, do_sample=True)}), 200, ""),
    ("temperature past float32", "/generate",
     raw({"inputs": "x", "parameters": params(temperature=1e300, do_sample=True)}), 422,
     "temperature"),
    ("tiny top_p and typical_p", "/generate",
     raw({"inputs": "x", "parameters": params(top_p=5e-324, typical_p=5e-324, do_sample=True)}),
     200, ""),
    ("extreme penalties", "/generate",
     raw({"inputs": "x", "parameters": params(repetition_penalty=1e3, frequency_penalty=-2)}),
     200, ""),
    ("repetition_penalty past float32", "/generate",
     raw({"inputs": "x", "parameters": params(repetition_penalty=1e300)}), 422,
     "repetition_penalty"),
    ("100k-character stop string", "/generate",
     raw({"inputs": "x", "parameters": params(stop=["ab" * 50_000])}), 422, "at most 512"),
    ("10k stop sequences", "/generate",
     raw({"inputs": "x", "parameters": params(stop=["a"] * 10_000)}), 422, "stop"),
    ("only special tokens", "/generate", raw({"inputs": "<s></s><pad>", "parameters": params()}),
     200, ""),
    ("lone surrogate", "/generate", b'{"inputs": "a\\ud800b"}', 400, "surrogate"),
    ("lone surrogate in chat", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "\\udc00"}]}', 400, "surrogate"),
    ("surrogate pair", "/generate",
     raw({"inputs": "\U0001f600 smile", "parameters": params()}), 200, ""),
    ("RTL, combining, zero-width", "/generate",
     raw({"inputs": "\u202eabc\u0301\u0301\u200b\u200d\ufeff\u2066x", "parameters": params()}),
     200, ""),
    ("NUL characters", "/generate", raw({"inputs": "a\u0000b\u0000", "parameters": params()}),
     200, ""),
    ("non-UTF-8 body", "/generate", b'{"inputs": "\xc3\x28"}', 400, "UTF-8"),
    ("UTF-16 body", "/generate", '{"inputs": "x"}'.encode("utf-16"), 400, "UTF-8"),
    ("deeply nested JSON", "/generate", b"[" * 200_000 + b"]" * 200_000, 400, "nested"),
    ("deeply nested parameters", "/generate",
     b'{"inputs": "x", "parameters": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5000 + b"}", 400,
     "nested"),
    ("truncated JSON", "/v1/chat/completions", b'{"messages": [{"role": "us', 400, "JSON"),
    ("a JSON string", "/generate", b'"inputs"', 422, "JSON object"),
    ("inputs is an object", "/generate", raw({"inputs": {"a": 1}}), 422, "inputs"),
    ("messages is a string", "/v1/chat/completions", raw({"messages": "hi"}), 422, "messages"),
    ("chat with 1e309", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e309}', 422, "finite"),
]


@pytest.mark.parametrize(("name", "path", "body", "status", "fragment"), CASES,
                         ids=[c[0] for c in CASES])
def test_hostile_bodies(
    router: RouterProcess, client: httpx.Client,
    name: str, path: str, body: bytes, status: int, fragment: str,
) -> None:
    r = client.post(f"{router.url}{path}", content=body,
                    headers={"content-type": "application/json"})
    if status == 200:
        assert r.status_code == 200, r.text
        assert isinstance(r.json()["generated_text"], str)
    else:
        assert fragment in assert_error_shape(r, status)["error"]


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/xml"])
def test_any_content_type_is_read_as_json_or_refused_cleanly(
    router: RouterProcess, client: httpx.Client, content_type: str | None
) -> None:
    """Lenient like curl users expect (`curl -d` sends form-urlencoded): the body decides."""
    headers = {"content-type": content_type} if content_type else {}
    good = client.post(f"{router.url}/generate", content=raw({"inputs": "x",
                                                              "parameters": params()}),
                       headers=headers)
    assert good.status_code == 200, good.text
    bad = client.post(f"{router.url}/generate", content=b"inputs=x&max_new_tokens=2",
                      headers=headers)
    assert_error_shape(bad, 400)


def tokens(client: httpx.Client, url: str, text: str) -> int:
    r = client.post(f"{url}/tokenize", json={"inputs": text})
    if r.status_code == 422:  # /tokenize is bounded as a prompt is: the count is in the error
        error = assert_error_shape(r, 422)["error"]
        assert f"must have less than {MAX_INPUT} tokens. Given: " in error, error
        return int(error.rsplit(" ", 1)[1])
    assert r.status_code == 200
    return len(r.json())


def prompt(client: httpx.Client, url: str, count: int) -> str:
    """A prompt of exactly `count` tokens (BOS included), checked through /tokenize."""
    text = "a" + " a" * (count - 2)
    assert tokens(client, url, text) == count
    return text


def test_prompt_limits_hold_to_the_token(router: RouterProcess, client: httpx.Client) -> None:
    url = router.url

    def gen(inputs: str, **parameters: Any) -> httpx.Response:
        return client.post(f"{url}/generate", json={"inputs": inputs, "parameters": parameters})

    at_input = prompt(client, url, MAX_INPUT)
    assert gen(at_input, max_new_tokens=1).status_code == 200
    over = assert_error_shape(gen(prompt(client, url, MAX_INPUT + 1), max_new_tokens=1), 422)
    assert f"must have less than {MAX_INPUT} tokens. Given: {MAX_INPUT + 1}" in over["error"]
    # Exactly max_total_tokens: prompt + max_new_tokens == 200 is served, 201 is not.
    short = prompt(client, url, 60)
    exact = gen(short, max_new_tokens=MAX_TOTAL - 60, details=True)
    assert exact.status_code == 200, exact.text
    assert exact.json()["details"]["generated_tokens"] <= MAX_TOTAL - 60
    assert_error_shape(gen(short, max_new_tokens=MAX_TOTAL - 59), 422)
    # Truncation brings an over-long prompt within the limit (TGI keeps the end).
    cut = gen(prompt(client, url, 150), max_new_tokens=1, truncate=MAX_INPUT, details=True,
              decoder_input_details=True)
    assert cut.status_code == 200, cut.text
    assert len(cut.json()["details"]["prefill"]) == MAX_INPUT
    with client.stream("POST", f"{url}/generate_stream", json={
            "inputs": at_input, "parameters": {"max_new_tokens": MAX_TOTAL - MAX_INPUT}}) as r:
        events = list(sse_events(r))
    assert events[-1]["generated_text"] is not None


def _raw_exchange(url: str, request: bytes) -> bytes:
    """Sends raw bytes on a fresh connection and reads the answer until the server closes."""
    parts = urlparse(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def test_an_endless_header_gets_431_and_the_connection_closes(router: RouterProcess) -> None:
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (MAX_HEAD_BYTES * 4) + b"\r\n\r\n"
    answer = _raw_exchange(router.url, head)
    status, _, rest = answer.partition(b"\r\n")
    assert status == b"HTTP/1.1 431 Request Header Fields Too Large"
    body = json.loads(rest.split(b"\r\n\r\n", 1)[1])
    assert set(body) == {"error", "error_type"} and "too large" in body["error"]


def test_a_head_just_under_the_limit_and_a_big_body_in_one_write_are_served(
    router: RouterProcess,
) -> None:
    """Only head bytes count: a body sent in the same write as the headers is not a head."""
    body = json.dumps({"inputs": "hello", "parameters": params(), "pad": "x" * 300_000}).encode()
    request = (
        b"POST /generate HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nX-Fill: " + b"f" * (MAX_HEAD_BYTES - 1024) + b"\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    assert _raw_exchange(router.url, request).startswith(b"HTTP/1.1 200 OK\r\n")


def test_the_server_is_unharmed(router: RouterProcess, client: httpx.Client) -> None:
    """Runs last: nothing above crashed, failed a shard call, or leaked a block."""
    assert_unharmed(router, client)

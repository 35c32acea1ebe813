"""Property-based fuzz of /generate, /generate_stream and /v1/chat/completions bodies over real
HTTP to a real router and shard: never a 5xx, never a crash; every 4xx in the error shape; every
200 a well-formed answer (a complete stream, no error event); afterwards no shard call failed and
every KV block is free.

Bounded in CI (300 derandomized examples, seconds); PYTGI_SLOW=1 runs 3,000 random ones.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.http_helpers import metric
from tests.reliability.router_checks import assert_unharmed, error_body
from tests.router_process import RouterProcess
from tests.shard_process import ShardProcesses

SLOW = os.environ.get("PYTGI_SLOW") == "1"
FUZZ = settings(
    max_examples=3000 if SLOW else 300, derandomize=not SLOW, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                           HealthCheck.data_too_large],
)

# Text a tokenizer and a detokenizer find awkward: special tokens, bidi controls, combining and
# zero-width characters, NUL, astral characters; lone surrogates (escaped by json.dumps) only in
# the hostile bodies.
ODD = ["<s>", "</s>", "<pad>", "<|user|>", "\u202e", "\u2066", "\u0301", "\u200b", "\u200d",
       "\ufeff", "\u0000", "\U0001f600", "\n", "\\", '"', "\u00e9", "\u4e2d"]
texts = st.lists(st.sampled_from(ODD) | st.text(st.characters(exclude_categories=["Cs"]),
                                                max_size=6), max_size=6).map("".join)
wild_texts = st.lists(st.sampled_from([*ODD, "\ud800", "\udfff"]) | st.text(max_size=6),
                      max_size=6).map("".join)
huge_ints = st.sampled_from([-(2**64), -1, 0, 2**31 - 1, 2**31, 2**32, 2**63, 2**64 - 1, 2**64,
                             10**30])
odd_floats = st.sampled_from([0.0, -0.0, 5e-324, 1e-300, 0.5, 1.0, 2.0, 1e300, math.inf,
                              -math.inf, math.nan])
anything = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | huge_ints | odd_floats | wild_texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(wild_texts, inner, max_size=3),
    max_leaves=6,
)


def valid_or(strategy: st.SearchStrategy[Any], hostile: bool) -> st.SearchStrategy[Any]:
    """A value the server must accept or, in a hostile body, anything at all now and then."""
    return st.one_of(strategy, strategy, anything) if hostile else strategy


def few_tokens(hostile: bool) -> st.SearchStrategy[Any]:
    """max_new_tokens / max_tokens: always given (the default, the whole remaining context,
    would make a fuzz example cost seconds), else anything but null."""
    return valid_or(st.integers(1, 3), hostile).filter(lambda value: value is not None)


def generate_body(hostile: bool) -> st.SearchStrategy[dict[str, Any]]:
    v = lambda strategy: valid_or(strategy, hostile)  # noqa: E731
    positive = st.floats(1e-300, 1e300) | st.sampled_from([5e-324, 1e-300, 1e300])
    unit = st.floats(5e-324, 1.0, exclude_min=False) | st.just(5e-324)
    params = st.fixed_dictionaries({"max_new_tokens": few_tokens(hostile)}, optional={
        "do_sample": v(st.booleans()),
        "temperature": v(positive),
        "top_k": v(st.integers(1, 2**31 - 1)),
        "top_p": v(unit),
        "typical_p": v(st.floats(5e-324, 0.999)),
        "repetition_penalty": v(positive),
        "frequency_penalty": v(st.floats(-2.0, 2.0)),
        "seed": v(st.integers(0, 2**64 - 1)),
        "stop": v(st.lists(texts, max_size=4)),
        "truncate": v(st.integers(1, 99)),
        "top_n_tokens": v(st.integers(0, 5)),
        "details": v(st.booleans()),
        "watermark": v(st.booleans()),
        "return_full_text": v(st.booleans()),
        **({"decoder_input_details": anything, "best_of": anything, "grammar": anything,
            "adapter_id": anything} if hostile else {}),
    })
    return st.fixed_dictionaries({"inputs": v(texts), "parameters": params})


def chat_body(hostile: bool) -> st.SearchStrategy[dict[str, Any]]:
    v = lambda strategy: valid_or(strategy, hostile)  # noqa: E731
    content = texts | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
                               min_size=1, max_size=2)
    message = st.fixed_dictionaries({"role": v(st.sampled_from(["user", "assistant", "system"])),
                                     "content": v(content)})
    return st.fixed_dictionaries({"messages": v(st.lists(message, min_size=1, max_size=3)),
                                  "max_tokens": few_tokens(hostile)}, optional={
        "temperature": v(st.floats(0.0, 2.0)),
        "top_p": v(st.floats(5e-324, 1.0)), "seed": v(st.integers(0, 2**64 - 1)),
        "stop": v(st.lists(texts, max_size=4)), "logprobs": v(st.booleans()),
        "top_logprobs": v(st.integers(0, 5)), "frequency_penalty": v(st.floats(-2.0, 2.0)),
        "presence_penalty": v(st.floats(-2.0, 2.0)), "stream": v(st.booleans()),
        "stream_options": v(st.fixed_dictionaries({"include_usage": st.booleans()})),
        **({"logit_bias": anything, "response_format": anything, "tools": anything,
            "n": anything, "model": anything} if hostile else {}),
    })


def encode(body: Any) -> bytes:
    """JSON with infinities written as 1e309 (which parsers read as infinity) and NaN as the
    non-standard literal; lone surrogates come out as \\ud800-style escapes."""
    text = json.dumps(body)
    return text.replace("-Infinity", "-1e309").replace("Infinity", "1e309").encode()


requests = st.one_of(*(
    st.one_of(
        st.tuples(st.sampled_from(["/generate", "/generate_stream"]),
                  generate_body(hostile).map(encode)),
        st.tuples(st.just("/v1/chat/completions"), chat_body(hostile).map(encode)),
    )
    for hostile in (False, True)
), st.tuples(st.sampled_from(["/generate", "/v1/chat/completions"]), st.binary(max_size=64)))


@pytest.fixture(scope="module")
def router(shard: ShardProcesses, llama: Path) -> Iterator[RouterProcess]:
    with RouterProcess(shard.urls[0], llama, "--max-input-tokens", "100",
                       "--max-total-tokens", "200") as process:
        yield process


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60) as c:
        yield c


def check_sse(r: httpx.Response, path: str) -> None:
    data = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
    assert data, "an empty stream"
    events = [json.loads(d) for d in data if d != "[DONE]"]
    assert not any("error" in e for e in events), events[-1]
    if path == "/generate_stream":
        assert events[-1]["generated_text"] is not None
    else:
        assert data[-1] == "[DONE]"


@FUZZ
@given(request=requests)
def test_fuzzed_bodies_get_an_answer_or_a_clean_4xx(
    router: RouterProcess, client: httpx.Client, request: tuple[str, bytes]
) -> None:
    path, body = request
    with client.stream("POST", f"{router.url}{path}", content=body,
                       headers={"content-type": "application/json"}) as r:
        if r.status_code == 200:
            if r.headers["content-type"].startswith("text/event-stream"):
                check_sse(r, path)
            else:
                answer = json.loads(r.read())
                assert isinstance(answer, dict) and answer
            return
        r.read()
    assert 400 <= r.status_code < 500, (r.status_code, r.text, body[:300])
    error_body(r)


def test_the_fuzz_left_the_server_unharmed(router: RouterProcess, client: httpx.Client) -> None:
    # Validation let nothing through that a shard would refuse (no failed shard call).
    assert_unharmed(router, client)
    assert metric(router.url, "tgi_request_success") > 30, "the fuzz must reach the shard too"

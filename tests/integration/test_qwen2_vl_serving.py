"""Qwen2-VL and Qwen2.5-VL end to end (issue 28): the router reads, processes and sends images, the shard runs
its vision tower and M-RoPE decoder; the served greedy tokens and logprobs equal transformers'
Qwen2VLForConditionalGeneration.generate on the same prompt ids and processed image, through
/generate with a markdown data-URI image and /v1/chat/completions with a data: PNG part. Two
different images give different outputs and never share the image's prefix-cache blocks; the
same image and prompt again hits the cache."""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image as PILImage

from tests.router_process import RouterProcess
from tests.shard_process import start_shards
from tests.unit.router.http.media.images import data_uri
from tests.unit.shard.models.qwen2_vl.vlm_cases import Prompt, hf_generate, process
from tests.vision_models import write_qwen2_vl_model

MAX_NEW = 5
TOL = 1e-3


def png(seed: int, size: tuple[int, int] = (60, 40)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    PILImage.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


SERVED = [("qwen2_vl", 1), ("qwen2_vl", 2), ("qwen2_5_vl", 1), ("qwen2_5_vl", 2)]


@pytest.fixture(scope="module", params=SERVED, ids=[f"{f}-{n}rank" for f, n in SERVED])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[str, Path]]:
    family, ranks = request.param
    model = write_qwen2_vl_model(tmp_path_factory.mktemp(family), family=family)
    with start_shards(model, ranks) as shards, RouterProcess(
        shards.urls[0], model, "--max-total-tokens", "256", "--max-input-tokens", "200",
    ) as router:
        yield router.url, model


@pytest.fixture
def server(served: tuple[str, Path]) -> str:
    return served[0]


@pytest.fixture
def model(served: tuple[str, Path]) -> Path:
    return served[1]


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def expected(model: Path, ids: list[int], image_png: bytes) -> tuple[list[int], list[float]]:
    """transformers on the prompt ids the server ran and the same image processed by
    transformers' own processor."""
    from tokenizers import Tokenizer

    pad = Tokenizer.from_file(str(model / "tokenizer.json")).token_to_id("<|image_pad|>")
    processed = process(model, PILImage.open(io.BytesIO(image_png)).convert("RGB"))
    offset = ids.index(pad)
    assert ids[offset : offset + processed.tokens] == [pad] * processed.tokens
    return hf_generate(model, Prompt(ids, [(offset, processed)]), MAX_NEW)


def generate(url: str, image_png: bytes, text: str = "look at", prefill: bool = True
             ) -> dict[str, Any]:
    """/generate's details; `prefill`: with the prompt's (decoder_input_details, which also
    keeps the request from reusing cached blocks: it wants every prompt token's logprob)."""
    r = post(url, "/generate", {"inputs": f"{text} ![]({data_uri(image_png)}) and say",
                                "parameters": {"max_new_tokens": MAX_NEW, "details": True,
                                               "decoder_input_details": prefill}})
    assert r.status_code == 200, r.text
    return dict(r.json()["details"])


def cached_tokens(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    match = re.search(r"^pytgi_request_cached_tokens_sum (\S+)$", text, re.M)
    assert match, "pytgi_request_cached_tokens_sum is missing"
    return float(match.group(1))


def test_generate_with_a_markdown_image_equals_transformers(server: str, model: Path) -> None:
    image = png(1)
    details = generate(server, image)
    ids = [t["id"] for t in details["prefill"]]
    tokens, logprobs = expected(model, ids, image)
    got = details["tokens"]
    n = len(got)  # EOS may end it early (transformers ignored it)
    assert [t["id"] for t in got] == tokens[:n] and n >= 1
    np.testing.assert_allclose([t["logprob"] for t in got], logprobs[:n], rtol=TOL, atol=TOL)


def test_chat_with_a_data_png_equals_transformers(server: str, model: Path) -> None:
    from tokenizers import Tokenizer

    image = png(2)
    body: dict[str, Any] = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is "},
        {"type": "image_url", "image_url": {"url": data_uri(image)}}]}],
        "max_tokens": MAX_NEW, "temperature": 0, "logprobs": True}
    tokenized = post(server, "/chat_tokenize", body)
    assert tokenized.status_code == 200, tokenized.text
    ids = [t["id"] for t in tokenized.json()["tokenize_response"]]
    tokens, logprobs = expected(model, ids, image)
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    served = [t["logprob"] for t in choice["logprobs"]["content"]]
    n = len(served)
    assert n >= 1
    np.testing.assert_allclose(served, logprobs[:n], rtol=TOL, atol=TOL)
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    assert choice["message"]["content"] == tok.decode(tokens[:n], skip_special_tokens=True)


def test_different_images_differ_and_share_only_the_text_before_them(server: str) -> None:
    red, blue = png(3), png(4)
    first = generate(server, red, "compare")
    before = cached_tokens(server)
    other = generate(server, blue, "compare", prefill=False)
    after_other = cached_tokens(server)
    assert [t["id"] for t in first["tokens"]] != [t["id"] for t in other["tokens"]]
    # Only whole blocks of the text before the image could match.
    pad_at = next(i for i, t in enumerate(first["prefill"]) if t["text"] == "<|image_pad|>")
    assert after_other - before <= pad_at
    again = generate(server, red, "compare", prefill=False)
    hit = cached_tokens(server) - after_other
    assert hit > pad_at  # the image's blocks and beyond were reused
    assert [t["id"] for t in again["tokens"]] == [t["id"] for t in first["tokens"]]
    np.testing.assert_allclose([t["logprob"] for t in again["tokens"]],
                               [t["logprob"] for t in first["tokens"]], rtol=TOL, atol=TOL)


def test_a_streamed_chat_with_an_image_gives_the_same_text(server: str) -> None:
    """Streaming goes through the existing path: the same tokens (their logprobs) and text; a
    stream holds back a last token that ends inside a UTF-8 character (random weights pick
    byte tokens), which the whole answer shows as U+FFFD."""
    image = png(5)
    body: dict[str, Any] = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_uri(image)}},
        {"type": "text", "text": "describe"}]}], "max_tokens": MAX_NEW, "temperature": 0,
        "logprobs": True}
    whole = post(server, "/v1/chat/completions", body)
    assert whole.status_code == 200, whole.text
    pieces, logprobs = [], []
    with httpx.stream("POST", f"{server}/v1/chat/completions", json={**body, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    pieces.append(choice["delta"].get("content") or "")
                    for t in (choice.get("logprobs") or {}).get("content") or ():
                        logprobs.append(t["logprob"])
    answer = whole.json()["choices"][0]
    np.testing.assert_allclose(logprobs, [t["logprob"] for t in answer["logprobs"]["content"]],
                               rtol=TOL, atol=TOL)
    text = "".join(pieces)
    assert answer["message"]["content"].startswith(text)
    assert set(answer["message"]["content"][len(text):]) <= {"\ufffd"}

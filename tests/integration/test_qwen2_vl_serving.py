"""Qwen2-VL and Qwen2.5-VL end to end (issue 28): the router reads, processes and sends images, the shard runs
its vision tower and M-RoPE decoder; the served greedy tokens and logprobs equal transformers'
Qwen2VLForConditionalGeneration.generate on the same prompt ids and processed image, through
/generate with a markdown data-URI image and /v1/chat/completions with a data: PNG part. Two
different images give different outputs and never share the image's prefix-cache blocks; the
same image and prompt again hits the cache. One server start per (family, ranks), every test
against it (tests/integration/vlm_serving.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import numpy as np
from tokenizers import Tokenizer

from tests.integration.vlm_serving import (
    MAX_NEW,
    TOL,
    Served,
    chat_body,
    chat_equals_transformers,
    generate,
    generate_equals_transformers,
    picture,
    png,
    post,
    serving,
)
from tests.unit.router.http.media.images import data_uri
from tests.unit.shard.models.qwen2_vl.vlm_cases import Prompt, hf_generate, process
from tests.vision_models import write_qwen2_vl_model

SERVED = [("qwen2_vl", 1), ("qwen2_vl", 2), ("qwen2_5_vl", 1), ("qwen2_5_vl", 2)]
served = serving(SERVED, lambda path, family: write_qwen2_vl_model(path, family=family),
                 "--max-total-tokens", "256", "--max-input-tokens", "200",
                 "--max-batch-prefill-tokens", "200")


def expected(model: Path, ids: list[int], image_png: bytes) -> tuple[list[int], list[float]]:
    """transformers on the prompt ids the server ran and the same image processed by
    transformers' own processor."""
    pad = Tokenizer.from_file(str(model / "tokenizer.json")).token_to_id("<|image_pad|>")
    processed = process(model, picture(image_png))
    offset = ids.index(pad)
    assert ids[offset : offset + processed.tokens] == [pad] * processed.tokens
    return hf_generate(model, Prompt(ids, [(offset, processed)]), MAX_NEW)


def oracle(served: Served, ids: list[int], images: list[bytes]) -> tuple[list[int], list[float]]:
    (image,) = images
    return expected(served.model, ids, image)


def markdown(image_png: bytes, text: str = "look at") -> str:
    return f"{text} ![]({data_uri(image_png)}) and say"


def cached_tokens(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    match = re.search(r"^pytgi_request_cached_tokens_sum (\S+)$", text, re.M)
    assert match, "pytgi_request_cached_tokens_sum is missing"
    return float(match.group(1))


def test_generate_with_a_markdown_image_equals_transformers(served: Served) -> None:
    image = png(1)
    generate_equals_transformers(served, markdown(image), [image], oracle)


def test_chat_with_a_data_png_equals_transformers(served: Served) -> None:
    chat_equals_transformers(served, ["what is ", png(2)], oracle)


def test_different_images_differ_and_share_only_the_text_before_them(served: Served) -> None:
    server, red, blue = served.url, png(3), png(4)
    first = generate(server, markdown(red, "compare"))
    before = cached_tokens(server)
    other = generate(server, markdown(blue, "compare"), prefill=False)
    after_other = cached_tokens(server)
    assert [t["id"] for t in first["tokens"]] != [t["id"] for t in other["tokens"]]
    # Only whole blocks of the text before the image could match.
    pad_at = next(i for i, t in enumerate(first["prefill"]) if t["text"] == "<|image_pad|>")
    assert after_other - before <= pad_at
    again = generate(server, markdown(red, "compare"), prefill=False)
    hit = cached_tokens(server) - after_other
    assert hit > pad_at  # the image's blocks and beyond were reused
    assert [t["id"] for t in again["tokens"]] == [t["id"] for t in first["tokens"]]
    np.testing.assert_allclose([t["logprob"] for t in again["tokens"]],
                               [t["logprob"] for t in first["tokens"]], rtol=TOL, atol=TOL)


def test_a_streamed_chat_with_an_image_gives_the_same_text(served: Served) -> None:
    """Streaming goes through the existing path: the same tokens (their logprobs) and text; a
    stream holds back a last token that ends inside a UTF-8 character (random weights pick
    byte tokens), which the whole answer shows as U+FFFD."""
    server, body = served.url, chat_body([png(5), "describe"])
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

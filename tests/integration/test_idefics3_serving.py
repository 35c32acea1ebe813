"""Idefics3 end to end (issue 28): the router resizes, tiles and places images as Idefics3's
processor does (each tile its own wire image over its run of `<image>` tokens); the shards run
the tower, connector and Llama decoder. The served greedy tokens and logprobs equal
transformers' generate on the prompt ids the server ran and the images processed by
transformers' own image processor, through /generate with a markdown data-URI image and
/v1/chat/completions with two data: PNGs (chunked: longer than the prefill budget), on 1 and 2
ranks (SmolVLM, the same model under its own classes, on 1); two different images give
different outputs; text only is served. One server start per (family, ranks)."""

from __future__ import annotations

import io
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image as PILImage
from tokenizers import Tokenizer

from tests.idefics3_models import IDEFICS3_SEQ_LEN, write_idefics3_model
from tests.integration.test_qwen2_vl_serving import png, post
from tests.router_process import RouterProcess
from tests.shard_process import start_shards
from tests.unit.router.http.media.images import data_uri
from tests.unit.shard.models.idefics3.idefics3_cases import Prompt, hf_generate, load_processor

MAX_NEW = 5
TOL = 1e-3


SERVED = [("idefics3", 1), ("idefics3", 2), ("smolvlm", 1)]


@pytest.fixture(scope="module", params=SERVED, ids=[f"{f}-{n}rank" for f, n in SERVED])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[str, Path]]:
    family, ranks = request.param
    model = write_idefics3_model(tmp_path_factory.mktemp(family), family=family)
    # A small prefill budget: the chat prompt below is chunked (through its tiles' runs).
    with start_shards(model, ranks) as shards, RouterProcess(
        shards.urls[0], model, "--max-total-tokens", "400", "--max-input-tokens", "300",
        "--max-batch-prefill-tokens", "48",
    ) as router:
        yield router.url, model


def expected(model: Path, ids: list[int], images: list[bytes]) -> tuple[list[int], list[float]]:
    """transformers on the prompt ids the server ran, the images' tiles made by transformers'
    image processor."""
    pixels = None
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    if images:
        pictures = [PILImage.open(io.BytesIO(b)).convert("RGB") for b in images]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pixels = load_processor(model).image_processor(  # type: ignore[attr-defined]
                [pictures], return_tensors="pt")["pixel_values"][0]
        assert ids.count(tok.token_to_id("<image>")) == IDEFICS3_SEQ_LEN * pixels.shape[0]
    return hf_generate(model, Prompt(ids, pixels, []), MAX_NEW)


def generate(url: str, inputs: str) -> dict[str, Any]:
    r = post(url, "/generate", {"inputs": inputs, "parameters": {
        "max_new_tokens": MAX_NEW, "details": True, "decoder_input_details": True}})
    assert r.status_code == 200, r.text
    return dict(r.json()["details"])


def assert_served(details: dict[str, Any], want: tuple[list[int], list[float]]) -> None:
    got = details["tokens"]
    n = len(got)  # EOS may end it early (transformers ignored it)
    assert n >= 1 and [t["id"] for t in got] == want[0][:n]
    np.testing.assert_allclose([t["logprob"] for t in got], want[1][:n], rtol=TOL, atol=TOL)


def test_served_as_transformers_generates(served: tuple[str, Path]) -> None:
    server, model = served
    # /generate, a markdown image: its tile grid's text in its place (TGI's rendering).
    image = png(1)
    details = generate(server, f"User:![]({data_uri(image)})What is it?")
    ids = [t["id"] for t in details["prefill"]]
    assert_served(details, expected(model, ids, [image]))

    # /v1/chat/completions, two data: PNG parts placed by the chat template; longer than the
    # prefill budget, so chunked.
    images = [png(2, (90, 40)), png(5, (30, 30))]
    body: dict[str, Any] = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Look at this"},
        {"type": "image_url", "image_url": {"url": data_uri(images[0])}},
        {"type": "text", "text": "and this one"},
        {"type": "image_url", "image_url": {"url": data_uri(images[1])}},
        {"type": "text", "text": "what is it?"}]}],
        "max_tokens": MAX_NEW, "temperature": 0, "logprobs": True}
    tokenized = post(server, "/chat_tokenize", body)
    assert tokenized.status_code == 200, tokenized.text
    ids = [t["id"] for t in tokenized.json()["tokenize_response"]]
    assert len(ids) > 48
    tokens, logprobs = expected(model, ids, images)
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    got = [t["logprob"] for t in choice["logprobs"]["content"]]
    n = len(got)
    assert n >= 1
    np.testing.assert_allclose(got, logprobs[:n], rtol=TOL, atol=TOL)
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    assert choice["message"]["content"] == tok.decode(tokens[:n], skip_special_tokens=True)

    # Two images of one size: different outputs (tokens, or at least their logprobs).
    first, other = (generate(server, f"![]({data_uri(png(seed))})compare") for seed in (3, 4))
    assert [t["id"] for t in first["prefill"]] == [t["id"] for t in other["prefill"]]
    assert [(t["id"], round(t["logprob"], 3)) for t in first["tokens"]] != [
        (t["id"], round(t["logprob"], 3)) for t in other["tokens"]]

    # The same image and prompt again (its tiles' blocks cached, keyed by each tile's hash):
    # the same tokens.
    again = post(server, "/generate", {"inputs": f"![]({data_uri(png(3))})compare",
                                        "parameters": {"max_new_tokens": MAX_NEW,
                                                       "details": True}})
    assert again.status_code == 200, again.text
    assert [t["id"] for t in again.json()["details"]["tokens"]] == [
        t["id"] for t in first["tokens"]]

    # Text only.
    details = generate(server, "just words here")
    assert_served(details, expected(model, [t["id"] for t in details["prefill"]], []))

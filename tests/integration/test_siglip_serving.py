"""PaliGemma and Gemma 3 end to end (issue 28): the router reads, processes and places images
as PaliGemmaProcessor / Gemma3Processor do and plans chunks around the bidirectional spans; the
shard runs the SigLIP tower, projector and the Gemma decoder with the spans' mask. The served
greedy tokens and logprobs equal transformers' generate on the prompt ids the server ran, the
image processed by transformers' own processor and its token_type_ids, through /generate with a
markdown data-URI image and /v1/chat/completions with a data: PNG, on 1 and 2 ranks. Two
different images give different outputs; a text-only request is served; a prompt longer than
the prefill budget is chunked around its spans. One server start per (family, ranks)."""

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

from tests.integration.test_qwen2_vl_serving import png, post
from tests.router_process import RouterProcess
from tests.shard_process import start_shards
from tests.siglip_models import load_processor, write_gemma3_model, write_paligemma_model
from tests.unit.router.http.media.images import data_uri
from tests.unit.shard.models.siglip.siglip_cases import Prompt, hf_generate

MAX_NEW = 5
TOL = 1e-3
SERVED = [("paligemma", 1), ("paligemma", 2), ("gemma3", 1), ("gemma3", 2)]
WRITERS = {"paligemma": write_paligemma_model, "gemma3": write_gemma3_model}


@pytest.fixture(scope="module", params=SERVED, ids=[f"{f}-{n}rank" for f, n in SERVED])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[str, Path, str]]:
    family, ranks = request.param
    model = WRITERS[family](tmp_path_factory.mktemp(family))
    # A small prefill budget: the longer prompts below are chunked (around their spans).
    with start_shards(model, ranks) as shards, RouterProcess(
        shards.urls[0], model, "--max-total-tokens", "400", "--max-input-tokens", "300",
        "--max-batch-prefill-tokens", "48",
    ) as router:
        yield router.url, model, family


def expected(model: Path, family: str, ids: list[int], images: list[bytes]
             ) -> tuple[list[int], list[float]]:
    """transformers on the prompt ids the server ran, the images processed by transformers'
    processor and the processor's token_type_ids (PaliGemma: 0, the prefix, over the prompt;
    Gemma 3: 1 on image soft tokens)."""
    processor = load_processor(model)
    pixels = None
    if images:
        pictures = [PILImage.open(io.BytesIO(b)).convert("RGB") for b in images]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pixels = processor.image_processor(pictures, return_tensors="pt")["pixel_values"]
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    if family == "paligemma":
        types = [0] * len(ids)
        assert ids.count(tok.token_to_id("<image>")) == 16 * len(images)
    else:
        soft = tok.token_to_id("<image_soft_token>")
        types = [int(t == soft) for t in ids]
        assert sum(types) == 4 * len(images)
    return hf_generate(model, Prompt(ids, pixels, types, []), MAX_NEW)


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


def test_served_as_transformers_generates(served: tuple[str, Path, str]) -> None:
    server, model, family = served
    # /generate, a markdown image (PaliGemma: where its <image> goes; Gemma 3: its image text).
    image = png(1)
    details = generate(server, f"![]({data_uri(image)})caption en")
    ids = [t["id"] for t in details["prefill"]]
    assert_served(details, expected(model, family, ids, [image]))

    # /v1/chat/completions, two data: PNG parts placed by the chat template; longer than the
    # prefill budget, so chunked (never inside a span).
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
    tokens, logprobs = expected(model, family, ids, images)
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

    # The same image and prompt again (its blocks cached): the same tokens.
    again = post(server, "/generate", {"inputs": f"![]({data_uri(png(3))})compare",
                                        "parameters": {"max_new_tokens": MAX_NEW,
                                                       "details": True}})
    assert again.status_code == 200, again.text
    assert [t["id"] for t in again.json()["details"]["tokens"]] == [
        t["id"] for t in first["tokens"]]

    # Text only.
    details = generate(server, "just words here")
    assert_served(details, expected(model, family, [t["id"] for t in details["prefill"]], []))

"""LLaVA-NeXT (and LLaVA 1.5, one tile per image) end to end (issue 28): the router reads,
processes (anyres) and sends images, the shard runs its CLIP tower, projector and anyres packing
into the Llama decoder; the served greedy tokens and logprobs equal transformers' generate
(LlavaNext/LlavaForConditionalGeneration) on the same prompt ids and the image processed by
transformers' own processor, through /generate with a markdown data-URI image and
/v1/chat/completions with a data: PNG, on 1 and 2 ranks (LLaVA 1.5 on 1). Two different images
give different outputs; a text-only request is served. One server start per family and rank
count, every check against it."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image as PILImage
from tokenizers import Tokenizer

from tests.integration.test_qwen2_vl_serving import png, post
from tests.router_process import RouterProcess
from tests.shard_process import start_shards
from tests.unit.router.http.media.images import data_uri
from tests.unit.shard.models.llava_next.llava_cases import Prompt, hf_generate, process
from tests.vision_checkpoints import LLAVA_IMAGE_TOKEN
from tests.vision_models import write_llava_next_model

MAX_NEW = 5
TOL = 1e-3


SERVED = [("llava_next", 1), ("llava_next", 2), ("llava", 1)]


@pytest.fixture(scope="module", params=SERVED, ids=[f"{f}-{n}rank" for f, n in SERVED])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[str, Path]]:
    family, ranks = request.param
    model = write_llava_next_model(tmp_path_factory.mktemp(family), family=family)
    with start_shards(model, ranks) as shards, RouterProcess(
        shards.urls[0], model, "--max-total-tokens", "400", "--max-input-tokens", "300",
    ) as router:
        yield router.url, model


@pytest.fixture
def server(served: tuple[str, Path]) -> str:
    return served[0]


@pytest.fixture
def model(served: tuple[str, Path]) -> Path:
    return served[1]


def expected(model: Path, ids: list[int], image_png: bytes | None
             ) -> tuple[list[int], list[float]]:
    """transformers on the prompt ids the server ran and the same image processed by
    transformers' own processor."""
    if image_png is None:
        return hf_generate(model, Prompt(ids, []), MAX_NEW)
    image_id = Tokenizer.from_file(str(model / "tokenizer.json")).token_to_id(LLAVA_IMAGE_TOKEN)
    processed = process(model, PILImage.open(io.BytesIO(image_png)).convert("RGB"))
    offset = ids.index(image_id)
    assert ids[offset : offset + processed.tokens + 1] == [image_id] * processed.tokens + [
        ids[offset + processed.tokens]] and ids.count(image_id) == processed.tokens
    return hf_generate(model, Prompt(ids, [(offset, processed)]), MAX_NEW)


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


def test_llava_next_served_as_transformers_generates(server: str, model: Path) -> None:
    # /generate, a markdown image (TGI renders it as the image tokens alone).
    image = png(1)
    details = generate(server, f"look at ![]({data_uri(image)}) and say")
    ids = [t["id"] for t in details["prefill"]]
    assert_served(details, expected(model, ids, image))

    # /v1/chat/completions, a data: PNG part placed by the chat template.
    image = png(2, (90, 40))
    body: dict[str, Any] = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_uri(image)}},
        {"type": "text", "text": "what is this"}]}],
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

    # Two images of one size: different outputs.
    first, other = (generate(server, f"compare ![]({data_uri(png(seed))})") for seed in (3, 4))
    assert [t["id"] for t in first["tokens"]] != [t["id"] for t in other["tokens"]]

    # Text only.
    details = generate(server, "just words here")
    assert_served(details, expected(model, [t["id"] for t in details["prefill"]], None))


def test_the_server_says_it_understands_images(server: str) -> None:
    """SGLang's model info (what its router reads) reports the images it takes."""
    r = httpx.get(f"{server}/model_info", timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["has_image_understanding"] is True

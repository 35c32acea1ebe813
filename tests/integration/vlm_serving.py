"""What the vision-language serving tests share (Qwen2-VL, LLaVA-NeXT, PaliGemma / Gemma 3,
Idefics3): a tiny checkpoint served by real shards (1 or 2 ranks) and a real router, started once
per (family, ranks) for every test of a file; /generate with a markdown data-URI image and
/v1/chat/completions with data: PNG parts; and the comparison of what was served with
transformers' greedy generate on the prompt ids the server ran (the family's oracle).

    served = serving(SERVED, write_model, "--max-total-tokens", "400", ...)

    def test_x(served: Served) -> None:
        assert_served(generate(served.url, "look ![](data:...)"), oracle(served, ids, [image]))
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image as PILImage
from tokenizers import Tokenizer

from tests.router_process import RouterProcess
from tests.shard_process import start_shards
from tests.unit.router.http.media.images import data_uri

MAX_NEW = 5
TOL = 1e-3
# The shards' KV cache: what the tests' few short requests need (256 blocks of 16 tokens), not
# the CPU default (10% of the RAM, which each start would allocate for nothing).
KV_TOKENS = 4096


@dataclass(frozen=True)
class Served:
    """A running router (its URL) in front of shards serving the checkpoint `model`."""

    url: str
    model: Path
    family: str
    ranks: int


# transformers' greedy (tokens, logprobs) on the prompt ids the server ran and the same images.
Oracle = Callable[[Served, list[int], list[bytes]], tuple[list[int], list[float]]]


def png(seed: int, size: tuple[int, int] = (60, 40)) -> bytes:
    """A random RGB PNG (width, height): different seeds, different pictures."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    PILImage.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def picture(image_png: bytes) -> PILImage.Image:
    return PILImage.open(io.BytesIO(image_png)).convert("RGB")


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def serving(cases: list[tuple[str, int]], write: Callable[[Path, str], Path], *flags: str
            ) -> Any:
    """The module-scoped `served` fixture over `cases` ((family, ranks)): `write(dir, family)`
    makes the checkpoint, shards and a router with `flags` serve it, once per case for every
    test of the module (pytest orders the tests by case)."""

    @pytest.fixture(scope="module", params=cases, ids=[f"{f}-{n}rank" for f, n in cases],
                    name="served")
    def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[Served]:
        family, ranks = request.param
        model = write(tmp_path_factory.mktemp(family), family)
        with start_shards(model, ranks) as shards, RouterProcess(
            shards.urls[0], model, "--max-batch-total-tokens", str(KV_TOKENS), *flags,
        ) as router:
            yield Served(router.url, model, family, ranks)

    return served


def generate(url: str, inputs: str, prefill: bool = True) -> dict[str, Any]:
    """/generate's details, greedy, MAX_NEW tokens; `prefill`: with the prompt's tokens
    (decoder_input_details, which also keeps the request from reusing cached blocks: it wants
    every prompt token's logprob)."""
    r = post(url, "/generate", {"inputs": inputs, "parameters": {
        "max_new_tokens": MAX_NEW, "details": True, "decoder_input_details": prefill}})
    assert r.status_code == 200, r.text
    return dict(r.json()["details"])


def assert_served(details: dict[str, Any], want: tuple[list[int], list[float]]) -> None:
    """/generate's tokens and logprobs are transformers' (EOS may end the served ones early:
    transformers ignored it)."""
    got = details["tokens"]
    n = len(got)
    assert n >= 1 and [t["id"] for t in got] == want[0][:n]
    np.testing.assert_allclose([t["logprob"] for t in got], want[1][:n], rtol=TOL, atol=TOL)


def generate_equals_transformers(served: Served, inputs: str, images: list[bytes],
                                 oracle: Oracle) -> dict[str, Any]:
    """/generate of `inputs` (markdown images `images`, in order) served as transformers
    generates on the prompt ids the server reports; its details."""
    details = generate(served.url, inputs)
    assert_served(details, oracle(served, [t["id"] for t in details["prefill"]], images))
    return details


def chat_body(content: list[str | bytes]) -> dict[str, Any]:
    """One user message of text parts and data: PNG parts, greedy, MAX_NEW tokens, logprobs."""
    parts = [{"type": "text", "text": c} if isinstance(c, str) else
             {"type": "image_url", "image_url": {"url": data_uri(c)}} for c in content]
    return {"messages": [{"role": "user", "content": parts}], "max_tokens": MAX_NEW,
            "temperature": 0, "logprobs": True}


def chat_equals_transformers(served: Served, content: list[str | bytes], oracle: Oracle,
                             ) -> list[int]:
    """/v1/chat/completions of one user message (text and data: PNGs placed by the chat
    template) gives transformers' logprobs and text on the ids /chat_tokenize reports for the
    same body; those ids."""
    body = chat_body(content)
    tokenized = post(served.url, "/chat_tokenize", body)
    assert tokenized.status_code == 200, tokenized.text
    ids = [t["id"] for t in tokenized.json()["tokenize_response"]]
    tokens, logprobs = oracle(served, ids, [c for c in content if isinstance(c, bytes)])
    r = post(served.url, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    got = [t["logprob"] for t in choice["logprobs"]["content"]]
    n = len(got)
    assert n >= 1
    np.testing.assert_allclose(got, logprobs[:n], rtol=TOL, atol=TOL)
    tok = Tokenizer.from_file(str(served.model / "tokenizer.json"))
    assert choice["message"]["content"] == tok.decode(tokens[:n], skip_special_tokens=True)
    return ids


def images_differ_and_a_repeat_is_the_same(served: Served, inputs: Callable[[bytes], str]
                                           ) -> None:
    """Two images of one size in the prompt `inputs(image)`: the same prompt ids, different
    outputs (tokens, or at least their logprobs); the first image and prompt again (its blocks
    cached, keyed by the image's hash): the same tokens."""
    first, other = (generate(served.url, inputs(png(seed))) for seed in (3, 4))
    assert [t["id"] for t in first["prefill"]] == [t["id"] for t in other["prefill"]]
    assert [(t["id"], round(t["logprob"], 3)) for t in first["tokens"]] != [
        (t["id"], round(t["logprob"], 3)) for t in other["tokens"]]
    again = generate(served.url, inputs(png(3)), prefill=False)
    assert [t["id"] for t in again["tokens"]] == [t["id"] for t in first["tokens"]]

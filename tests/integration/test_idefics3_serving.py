"""Idefics3 end to end (issue 28): the router resizes, tiles and places images as Idefics3's
processor does (each tile its own wire image over its run of `<image>` tokens); the shards run
the tower, connector and Llama decoder. The served greedy tokens and logprobs equal
transformers' generate on the prompt ids the server ran and the images processed by
transformers' own image processor, through /generate with a markdown data-URI image and
/v1/chat/completions with two data: PNGs (chunked: longer than the prefill budget), on 1 and 2
ranks (SmolVLM, the same model under its own classes, on 1); two different images give
different outputs; text only is served. One server start per (family, ranks)
(tests/integration/vlm_serving.py)."""

from __future__ import annotations

import warnings

from tokenizers import Tokenizer

from tests.idefics3_models import IDEFICS3_SEQ_LEN, write_idefics3_model
from tests.integration.vlm_serving import (
    MAX_NEW,
    Served,
    chat_equals_transformers,
    generate_equals_transformers,
    images_differ_and_a_repeat_is_the_same,
    picture,
    png,
    serving,
)
from tests.unit.router.http.media.images import data_uri
from tests.unit.shard.models.idefics3.idefics3_cases import Prompt, hf_generate, load_processor

SERVED = [("idefics3", 1), ("idefics3", 2), ("smolvlm", 1)]
# A small prefill budget: the chat prompt below is chunked (through its tiles' runs).
served = serving(SERVED, lambda path, family: write_idefics3_model(path, family=family),
                 "--max-total-tokens", "400", "--max-input-tokens", "300",
                 "--max-batch-prefill-tokens", "48")


def oracle(served: Served, ids: list[int], images: list[bytes]) -> tuple[list[int], list[float]]:
    """transformers on the prompt ids the server ran, the images' tiles made by transformers'
    image processor."""
    pixels = None
    if images:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pixels = load_processor(served.model).image_processor(  # type: ignore[attr-defined]
                [[picture(b) for b in images]], return_tensors="pt")["pixel_values"][0]
        tok = Tokenizer.from_file(str(served.model / "tokenizer.json"))
        assert ids.count(tok.token_to_id("<image>")) == IDEFICS3_SEQ_LEN * pixels.shape[0]
    return hf_generate(served.model, Prompt(ids, pixels, []), MAX_NEW)


def test_served_as_transformers_generates(served: Served) -> None:
    # /generate, a markdown image: its tile grid's text in its place (TGI's rendering).
    image = png(1)
    generate_equals_transformers(served, f"User:![]({data_uri(image)})What is it?", [image],
                                 oracle)

    # /v1/chat/completions, two data: PNG parts placed by the chat template; longer than the
    # prefill budget, so chunked.
    ids = chat_equals_transformers(served, [
        "Look at this", png(2, (90, 40)), "and this one", png(5, (30, 30)), "what is it?"],
        oracle)
    assert len(ids) > 48

    # Two images of one size: different outputs; the same image again: the same tokens.
    images_differ_and_a_repeat_is_the_same(served, lambda image: f"![]({data_uri(image)})compare")

    # Text only.
    generate_equals_transformers(served, "just words here", [], oracle)

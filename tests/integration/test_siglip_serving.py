"""PaliGemma and Gemma 3 end to end (issue 28): the router reads, processes and places images
as PaliGemmaProcessor / Gemma3Processor do and plans chunks around the bidirectional spans; the
shard runs the SigLIP tower, projector and the Gemma decoder with the spans' mask. The served
greedy tokens and logprobs equal transformers' generate on the prompt ids the server ran, the
image processed by transformers' own processor and its token_type_ids, through /generate with a
markdown data-URI image and /v1/chat/completions with a data: PNG, on 1 and 2 ranks. Two
different images give different outputs; a text-only request is served; a prompt longer than
the prefill budget is chunked around its spans. One server start per (family, ranks)
(tests/integration/vlm_serving.py)."""

from __future__ import annotations

import warnings

from tokenizers import Tokenizer

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
from tests.siglip_models import load_processor, write_gemma3_model, write_paligemma_model
from tests.unit.router.http.media.images import data_uri
from tests.unit.shard.models.siglip.siglip_cases import Prompt, hf_generate

SERVED = [("paligemma", 1), ("paligemma", 2), ("gemma3", 1), ("gemma3", 2)]
WRITERS = {"paligemma": write_paligemma_model, "gemma3": write_gemma3_model}
# A small prefill budget: the longer prompts below are chunked (around their spans).
served = serving(SERVED, lambda path, family: WRITERS[family](path),
                 "--max-total-tokens", "400", "--max-input-tokens", "300",
                 "--max-batch-prefill-tokens", "48")


def oracle(served: Served, ids: list[int], images: list[bytes]) -> tuple[list[int], list[float]]:
    """transformers on the prompt ids the server ran, the images processed by transformers'
    processor and the processor's token_type_ids (PaliGemma: 0, the prefix, over the prompt;
    Gemma 3: 1 on image soft tokens)."""
    model = served.model
    processor = load_processor(model)
    pixels = None
    if images:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pixels = processor.image_processor([picture(b) for b in images],
                                               return_tensors="pt")["pixel_values"]
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    if served.family == "paligemma":
        types = [0] * len(ids)
        assert ids.count(tok.token_to_id("<image>")) == 16 * len(images)
    else:
        soft = tok.token_to_id("<image_soft_token>")
        types = [int(t == soft) for t in ids]
        assert sum(types) == 4 * len(images)
    return hf_generate(model, Prompt(ids, pixels, types, []), MAX_NEW)


def test_served_as_transformers_generates(served: Served) -> None:
    # /generate, a markdown image (PaliGemma: where its <image> goes; Gemma 3: its image text).
    image = png(1)
    generate_equals_transformers(served, f"![]({data_uri(image)})caption en", [image], oracle)

    # /v1/chat/completions, two data: PNG parts placed by the chat template; longer than the
    # prefill budget, so chunked (never inside a span).
    ids = chat_equals_transformers(served, [
        "Look at this", png(2, (90, 40)), "and this one", png(5, (30, 30)), "what is it?"],
        oracle)
    assert len(ids) > 48

    # Two images of one size: different outputs; the same image again: the same tokens.
    images_differ_and_a_repeat_is_the_same(served, lambda image: f"![]({data_uri(image)})compare")

    # Text only.
    generate_equals_transformers(served, "just words here", [], oracle)

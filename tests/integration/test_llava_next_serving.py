"""LLaVA-NeXT (and LLaVA 1.5, one tile per image) end to end (issue 28): the router reads,
processes (anyres) and sends images, the shard runs its CLIP tower, projector and anyres packing
into the Llama decoder; the served greedy tokens and logprobs equal transformers' generate
(LlavaNext/LlavaForConditionalGeneration) on the same prompt ids and the image processed by
transformers' own processor, through /generate with a markdown data-URI image and
/v1/chat/completions with a data: PNG, on 1 and 2 ranks (LLaVA 1.5 on 1). Two different images
give different outputs; a text-only request is served. One server start per family and rank
count, every check against it (tests/integration/vlm_serving.py)."""

from __future__ import annotations

import httpx
from tokenizers import Tokenizer

from tests.integration.vlm_serving import (
    MAX_NEW,
    Served,
    chat_equals_transformers,
    generate,
    generate_equals_transformers,
    picture,
    png,
    serving,
)
from tests.unit.router.http.media.images import data_uri
from tests.unit.shard.models.llava_next.llava_cases import Prompt, hf_generate, process
from tests.vision_checkpoints import LLAVA_IMAGE_TOKEN
from tests.vision_models import write_llava_next_model

SERVED = [("llava_next", 1), ("llava_next", 2), ("llava", 1)]
served = serving(SERVED, lambda path, family: write_llava_next_model(path, family=family),
                 "--max-total-tokens", "400", "--max-input-tokens", "300",
                 "--max-batch-prefill-tokens", "300")


def oracle(served: Served, ids: list[int], images: list[bytes]) -> tuple[list[int], list[float]]:
    """transformers on the prompt ids the server ran and the same image processed by
    transformers' own processor."""
    model = served.model
    if not images:
        return hf_generate(model, Prompt(ids, []), MAX_NEW)
    (image,) = images
    image_id = Tokenizer.from_file(str(model / "tokenizer.json")).token_to_id(LLAVA_IMAGE_TOKEN)
    processed = process(model, picture(image))
    offset = ids.index(image_id)
    assert ids[offset : offset + processed.tokens + 1] == [image_id] * processed.tokens + [
        ids[offset + processed.tokens]] and ids.count(image_id) == processed.tokens
    return hf_generate(model, Prompt(ids, [(offset, processed)]), MAX_NEW)


def test_llava_next_served_as_transformers_generates(served: Served) -> None:
    # /generate, a markdown image (TGI renders it as the image tokens alone).
    image = png(1)
    generate_equals_transformers(served, f"look at ![]({data_uri(image)}) and say", [image],
                                 oracle)

    # /v1/chat/completions, a data: PNG part placed by the chat template.
    chat_equals_transformers(served, [png(2, (90, 40)), "what is this"], oracle)

    # Two images of one size: different outputs.
    first, other = (generate(served.url, f"compare ![]({data_uri(png(seed))})")
                    for seed in (3, 4))
    assert [t["id"] for t in first["tokens"]] != [t["id"] for t in other["tokens"]]

    # Text only.
    generate_equals_transformers(served, "just words here", [], oracle)


def test_the_server_says_it_understands_images(served: Served) -> None:
    """SGLang's model info (what its router reads) reports the images it takes."""
    r = httpx.get(f"{served.url}/model_info", timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["has_image_understanding"] is True

"""LLaVA-NeXT (and LLaVA 1.5, the same without anyres) on the shard against transformers' LlavaNextForConditionalGeneration on the same
tiny random weights and images processed by transformers' own processor: the CLIP tower +
projector + anyres packing equal get_image_features (1e-4) on images of several shapes; served
through the Engine, greedy tokens equal and logprobs within 1e-3 of generate with one image, two
images, text only, and in chunks that split an image (pixels only with the chunks computing its
tokens, the tower run once per image) and after a prefix-cache hit past the image (no pixels
sent); two images of one size give different tokens; wire images that do not fit the model are
refused in one line."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.engine.engine import Engine
from pytgi_shard.errors import InvalidRequest
from tests.unit.shard.engine.test_engine import Run
from tests.unit.shard.models.llava_next.llava_cases import (
    Prompt,
    hf_generate,
    hf_model,
    is_llava,
    process,
    prompt_with,
    stacked,
    wire_images,
)
from tests.unit.shard.models.qwen2_vl.test_qwen2_vl import as_router_sends
from tests.unit.shard.models.qwen2_vl.vlm_cases import picture
from tests.unit.shard.router_steps import BLOCK, Router, build_engine, reference_run, request
from tests.vision_models import write_llava_next_model

MAX_NEW = 6
TOL = 1e-3


@pytest.fixture(scope="module", params=["llava_next", "llava"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    family = request.param
    return write_llava_next_model(tmp_path_factory.mktemp(family), family=family)


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Engine:
    return build_engine(model_dir)


@pytest.fixture
def fresh(engine: Engine) -> Engine:
    engine.clear(None)
    engine.model.images = type(engine.model.images)()  # type: ignore[attr-defined]
    return engine


def one_image(model_dir: Path, seed: int = 1, size: tuple[int, int] = (60, 40)) -> Prompt:
    image = process(model_dir, picture(size, seed))
    return prompt_with(model_dir, [[10, 11, 12], image, [13, 14, 15, 16, 17]])


def two_images(model_dir: Path) -> Prompt:
    a = process(model_dir, picture((60, 40), 2))
    b = process(model_dir, picture((40, 90), 3))
    return prompt_with(model_dir, [[20, 21], a, [22, 23, 24], b, [25, 26, 27]])


def vlm_request(rid: int, prompt: Prompt, **fields: object) -> pb.Request:
    return request(rid, prompt.ids, max_new=MAX_NEW, blocks=[], images=wire_images(prompt),
                   **fields)


def assert_run(run: Run, rid: int, expected: tuple[list[int], list[float]]) -> None:
    assert run.tokens[rid] == expected[0]
    torch.testing.assert_close(run.logprobs[rid], expected[1], rtol=TOL, atol=TOL)


@pytest.mark.parametrize("size", [(60, 40), (40, 90), (20, 20), (100, 33), (64, 64), (90, 2)])
def test_encode_equals_transformers_image_features(
    engine: Engine, model_dir: Path, size: tuple[int, int]
) -> None:
    image = process(model_dir, picture(size, 7))
    with torch.no_grad():
        out = hf_model(model_dir).model.get_image_features(
            **stacked([image], is_llava(model_dir)), vision_feature_layer=-2,
            vision_feature_select_strategy="default").pooler_output
    theirs = out[0] if isinstance(out, (list, tuple)) else out.reshape(-1, out.shape[-1])
    ours = engine.model.encode(image.pixel_values, image.size)  # type: ignore[attr-defined]
    assert ours.shape == theirs.shape == (image.tokens, 64)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["one_image", "two_images", "text_only"])
def test_greedy_tokens_and_logprobs_equal_transformers(
    fresh: Engine, model_dir: Path, case: str
) -> None:
    prompt = {"one_image": one_image, "two_images": two_images,
              "text_only": lambda d: prompt_with(d, [[30, 31, 32, 33, 34]])}[case](model_dir)
    expected = hf_generate(model_dir, prompt, MAX_NEW)
    run = reference_run(fresh, [vlm_request(1, prompt)])
    assert_run(run, 1, expected)
    assert len(fresh.model.images) == 0  # type: ignore[attr-defined]


def test_two_images_give_different_outputs(fresh: Engine, model_dir: Path) -> None:
    red, blue = one_image(model_dir, seed=4), one_image(model_dir, seed=5)
    assert red.ids == blue.ids  # the same text and image size: only the pixels differ
    run = reference_run(fresh, [vlm_request(1, red), vlm_request(2, blue)])
    assert run.tokens[1] != run.tokens[2]
    assert_run(run, 1, hf_generate(model_dir, red, MAX_NEW))


def test_chunks_splitting_images_give_the_whole_prefill(fresh: Engine, model_dir: Path) -> None:
    """Chunks of 16 tokens (each image split across several), pixels only in the chunks that
    compute an image's tokens: the tower runs once per image, its kept rows freed after."""
    prompt = two_images(model_dir)
    expected = hf_generate(model_dir, prompt, MAX_NEW)
    encoded: list[tuple[int, ...]] = []
    encode = fresh.model.encode  # type: ignore[attr-defined]

    def counted(pixels: torch.Tensor, grid: tuple[int, ...]) -> torch.Tensor:
        encoded.append(grid)
        return encode(pixels, grid)

    fresh.model.encode = counted  # type: ignore[attr-defined]
    try:
        router = Router(fresh)
        batch_id = itertools.count(1).__next__
        r = vlm_request(1, prompt)
        for start in range(0, len(r.input_ids), 16):
            router.prefill(batch_id(), [as_router_sends(router.chunk(r, start, 16))])
        router.finish()
    finally:
        del fresh.model.encode  # type: ignore[attr-defined]
    assert encoded == [(40, 60), (90, 40)]
    assert_run(router.run, 1, expected)
    assert len(fresh.model.images) == 0  # type: ignore[attr-defined]


def test_wire_images_that_do_not_fit_are_refused(fresh: Engine, model_dir: Path) -> None:
    prompt = one_image(model_dir)
    tiles = prompt.images[0][1].pixel_values.shape[0]
    tile_bytes = 4 * 3 * 32 * 32
    cases = [("grid", [40], None, "grid \\[40\\] is not the image's \\(height, width\\)"),
             ("shape", [tiles + 1, 3, 32, 32], tile_bytes,
              f"pixel values of shape \\[{tiles + 1}, 3, 32, 32\\] are not float32 "
              f"\\[{tiles}, 3, 32, 32\\]")]
    if not is_llava(model_dir):  # LLaVA 1.5 takes 16 tokens whatever the size
        cases.append(("grid", [40, 200], None, "an image of 40 x 200 takes \\d+ tokens, not 70"))
    for field, value, extra, message in cases:
        r = vlm_request(1, prompt)
        image = r.images[0]
        if extra:
            image.pixel_values += bytes(extra)
        getattr(image, field)[:] = value
        with pytest.raises(InvalidRequest, match=f"request 1: image 0: {message}"):
            reference_run(fresh, [r])


def test_a_prefix_cache_hit_past_the_image_gives_the_cold_tokens(
    fresh: Engine, model_dir: Path
) -> None:
    """B's first blocks are A's (same image and text): B computes only the text after the
    image, its chunk carrying the image's grid and span but no pixels (1-D positions: nothing
    of the image is needed)."""
    prompt = one_image(model_dir)
    cold = reference_run(fresh, [vlm_request(1, prompt)])  # A on blocks 1..
    end_of_image = prompt.images[0][0] + prompt.images[0][1].tokens
    cache_len = (end_of_image // BLOCK + 1) * BLOCK
    assert cache_len < len(prompt.ids)
    shared = cache_len // BLOCK
    total = len(prompt.ids) + MAX_NEW
    blocks = list(range(1, 1 + shared)) + list(range(60, 60 + -(-total // BLOCK) - shared))
    b = as_router_sends(vlm_request(2, prompt, cache_len=cache_len))
    b.blocks[:] = blocks
    assert not b.images[0].pixel_values
    warm = Run(fresh)
    warm.finish(warm.prefill(pb.Batch(id=2, requests=[b])))
    assert warm.tokens[2] == cold.tokens[1]
    torch.testing.assert_close(warm.logprobs[2], cold.logprobs[1], rtol=TOL, atol=TOL)


def test_warmup_encodes_the_most_tiles_an_image_can_have(fresh: Engine, model_dir: Path
                                                         ) -> None:
    """Warmup's peak (the KV cache's sizing) includes the tower on the largest pinpoint's tiles
    (64 x 64: 2 x 2 tiles and the base one; LLaVA 1.5: its one tile)."""
    model = fresh.model
    seen: list[tuple[int, tuple[int, ...]]] = []
    encode = model.encode  # type: ignore[attr-defined]

    def counted(pixels: torch.Tensor, grid: tuple[int, ...]) -> torch.Tensor:
        seen.append((pixels.shape[0], grid))
        return encode(pixels, grid)

    model.encode = counted  # type: ignore[attr-defined]
    try:
        fresh.warmup(pb.WarmupRequest(max_prefill_tokens=128, max_batch_total_tokens=2048))
    finally:
        del model.encode  # type: ignore[attr-defined]
    assert seen == ([(1, (32, 32))] if is_llava(model_dir) else [(5, (64, 64))])

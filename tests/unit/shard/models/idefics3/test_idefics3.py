"""Idefics3 (and SmolVLM, the same model under its own transformers classes) served by the
shard's Engine against transformers on the same tiny random weights and
processed inputs: one tile through tower + connector equals transformers' image features; greedy
tokens equal generate's and logprobs within 1e-3 with one image (split into tiles), two images,
and text only; chunks cutting around and through the images give the whole
prefill's tokens (tower once per tile); two images give different outputs; wrong tiles are
refused in one line."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from pytgi_shard.engine.engine import Engine
from pytgi_shard.errors import InvalidRequest
from pytgi_shard.models.idefics3.model import bucketed_positions, pixel_shuffle
from tests.idefics3_models import IDEFICS3_SEQ_LEN, IDEFICS3_TILE, write_idefics3_model
from tests.unit.shard.engine.test_engine import Run
from tests.unit.shard.models.idefics3.idefics3_cases import (
    Prompt,
    hf_generate,
    idefics3_prompt,
    picture,
    wire_images,
)
from tests.unit.shard.router_steps import Router, build_engine, reference_run, request

MAX_NEW = 6
TOL = 1e-3


@pytest.fixture(scope="module", params=["idefics3", "smolvlm"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_idefics3_model(tmp_path_factory.mktemp(request.param), family=request.param)


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Engine:
    return build_engine(checkpoint)


def served(engine: Engine, prompts: list[Prompt]) -> Run:
    engine.clear(None)
    return reference_run(engine, [
        request(k + 1, p.ids, max_new=MAX_NEW, blocks=[], images=wire_images(p))
        for k, p in enumerate(prompts)])


def assert_equal(run: Run, rid: int, expected: tuple[list[int], list[float]]) -> None:
    assert run.tokens[rid] == expected[0]
    torch.testing.assert_close(run.logprobs[rid], expected[1], rtol=TOL, atol=TOL)


def test_positions_and_pixel_shuffle_are_transformers(checkpoint: Path, engine: Engine) -> None:
    from transformers import AutoModelForImageTextToText

    for side in (3, 7, 16, 26, 32):  # float32 bucketing is not arange for 3 and 7
        mask = torch.ones(1, side, side, dtype=torch.bool)
        from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionEmbeddings

        emb = Idefics3VisionEmbeddings.__new__(Idefics3VisionEmbeddings)
        torch.nn.Module.__init__(emb)
        emb.patch_size, emb.num_patches_per_side = 1, side
        emb.patch_embedding = torch.nn.Identity()
        emb.position_embedding = torch.nn.Embedding(side * side, 1)
        emb.position_embedding.weight.data = torch.arange(side * side, dtype=torch.float32)[:, None]
        got = emb(torch.zeros(1, 1, side, side), mask)[0, :, 0].long()
        assert torch.equal(got, bucketed_positions(side))
    model = AutoModelForImageTextToText.from_pretrained(checkpoint).eval()
    x = torch.randn(16, 8)
    torch.testing.assert_close(pixel_shuffle(x, 2),
                               model.model.connector.pixel_shuffle(x[None], 2)[0])
    tile = torch.randn(3, IDEFICS3_TILE, IDEFICS3_TILE)
    with torch.no_grad():
        expected = model.model.get_image_features(tile[None, None]).pooler_output[0]
    got = engine.model.encode(tile, ())  # type: ignore[operator]
    assert got.shape == (IDEFICS3_SEQ_LEN, 64)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def cases(path: Path) -> list[Prompt]:
    return [
        idefics3_prompt(path, [picture((70, 50), 1), "What is this?"]),
        idefics3_prompt(path, [picture((40, 90), 2), "and", picture((20, 20), 3), "so"]),
        idefics3_prompt(path, ["Hello world! How are you today?"]),
    ]


def test_equals_transformers(checkpoint: Path, engine: Engine) -> None:
    prompts = cases(checkpoint)
    # Longest edge 96 in tiles of 32: 70 x 50 -> 96 x 68 -> 3 x 3 tiles + the global image.
    assert len(prompts[0].spans) == 10
    assert len(prompts[1].spans) == 7 + 10 and not prompts[2].spans  # 3 rows x 2 cols + 1
    run = served(engine, prompts)
    for rid, prompt in enumerate(prompts, start=1):
        assert_equal(run, rid, hf_generate(checkpoint, prompt, MAX_NEW))
    assert len(engine.model.images) == 0  # type: ignore[attr-defined]


def test_two_images_give_different_outputs(engine: Engine, checkpoint: Path) -> None:
    a, b = (idefics3_prompt(checkpoint, [picture((70, 50), s), "What?"]) for s in (4, 5))
    assert a.ids == b.ids
    run = served(engine, [a, b])
    assert run.tokens[1] != run.tokens[2] or max(
        abs(x - y) for x, y in zip(run.logprobs[1], run.logprobs[2], strict=True)) > 1e-2


@pytest.mark.parametrize("chunk", [5, 16])
def test_chunks_around_and_through_images_give_the_whole_prefill(
        checkpoint: Path, engine: Engine, chunk: int) -> None:
    """Chunks of `chunk` tokens (cutting tiles' runs), mixed with another request's decode:
    transformers' tokens; the tower runs once per tile."""
    engine.clear(None)
    prompt = idefics3_prompt(checkpoint, [picture((70, 50), 1), "and",
                                          picture((40, 90), 2), "what?"])
    expected = hf_generate(checkpoint, prompt, MAX_NEW)
    r = request(1, prompt.ids, max_new=MAX_NEW, blocks=[], images=wire_images(prompt))
    model = engine.model
    calls = 0
    encode = model.encode  # type: ignore[attr-defined]

    def counted(*args: object) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return encode(*args)

    model.encode = counted  # type: ignore[attr-defined]
    try:
        router = Router(engine)
        batch_id = itertools.count(1).__next__
        cuts = [*range(0, len(prompt.ids), chunk), len(prompt.ids)]
        for start, end in itertools.pairwise(cuts):
            router.prefill(batch_id(), [router.chunk(r, start, end - start)])
        router.finish()
    finally:
        del model.encode  # type: ignore[attr-defined]
    assert calls == len(prompt.spans)
    assert_equal(router.run, 1, expected)


def test_wrong_tiles_are_refused_in_one_line(checkpoint: Path, engine: Engine) -> None:
    engine.clear(None)
    prompt = idefics3_prompt(checkpoint, [picture((20, 20), 1), "What?"])
    r = request(1, prompt.ids, max_new=MAX_NEW, blocks=[], images=wire_images(prompt))
    r.images[0].shape[:] = [3, 16, 64]
    with pytest.raises(InvalidRequest, match=r"not float32 \[3, 32, 32\]"):
        reference_run(engine, [r])
    r = request(1, prompt.ids, max_new=MAX_NEW, blocks=[], images=wire_images(prompt))
    r.images[0].token_count = 3
    with pytest.raises(InvalidRequest, match="take 4"):
        reference_run(engine, [r])

"""PaliGemma (1 and 2) and Gemma 3 served by the shard's Engine against transformers' generate
on the same tiny random weights and processed inputs: greedy tokens equal, logprobs within
1e-3, with one and two images and text only; chunks that keep each bidirectional span whole
(as the router plans them); a chunk that splits one refused."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.engine.engine import Engine
from pytgi_shard.errors import InvalidRequest
from tests.siglip_models import write_gemma3_model, write_paligemma_model
from tests.unit.shard.engine.test_engine import Run
from tests.unit.shard.models.siglip.siglip_cases import (
    Prompt,
    gemma3_prompt,
    hf_generate,
    paligemma_prompt,
    picture,
    wire_images,
)
from tests.unit.shard.router_steps import BLOCK, Router, build_engine, reference_run, request

MAX_NEW = 6
TOL = 1e-3


@pytest.fixture(scope="module")
def paligemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_paligemma_model(tmp_path_factory.mktemp("paligemma"))


@pytest.fixture(scope="module")
def paligemma1(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_paligemma_model(tmp_path_factory.mktemp("paligemma1"), text_model_type="gemma")


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gemma3_model(tmp_path_factory.mktemp("gemma3"))


def served(engine: Engine, prompts: list[Prompt]) -> Run:
    engine.clear(None)
    return reference_run(engine, [
        request(k + 1, p.ids, max_new=MAX_NEW, blocks=[], images=wire_images(p))
        for k, p in enumerate(prompts)])


def assert_equal(run: Run, rid: int, expected: tuple[list[int], list[float]]) -> None:
    assert run.tokens[rid] == expected[0]
    torch.testing.assert_close(run.logprobs[rid], expected[1], rtol=TOL, atol=TOL)


def paligemma_cases(path: Path) -> dict[str, Prompt]:
    return {
        "one_image": paligemma_prompt(path, "What is this?", [picture((40, 30), 1)]),
        "two_images": paligemma_prompt(path, "Compare", [picture((30, 60), 2),
                                                         picture((50, 50), 3)]),
        "text_only": paligemma_prompt(path, "Hello world! How are you", []),
    }


@pytest.mark.parametrize("family", ["paligemma", "paligemma1"])
def test_paligemma_equals_transformers(request: pytest.FixtureRequest, family: str) -> None:
    path: Path = request.getfixturevalue(family)
    engine = build_engine(path)
    cases = paligemma_cases(path)
    run = served(engine, list(cases.values()))
    for rid, prompt in enumerate(cases.values(), start=1):
        assert_equal(run, rid, hf_generate(path, prompt, MAX_NEW))
    assert len(engine.model.images) == 0  # type: ignore[attr-defined]


def test_gemma3_equals_transformers(gemma3: Path) -> None:
    engine = build_engine(gemma3)
    cases = [
        gemma3_prompt(gemma3, ["Look", picture((40, 30), 1), "what is it?"]),
        gemma3_prompt(gemma3, [picture((30, 60), 2), "and", picture((50, 50), 3), "so"]),
        gemma3_prompt(gemma3, ["Hello world! How are you today?"]),
    ]
    assert len(cases[1].spans) == 2 and not cases[2].spans
    run = served(engine, cases)
    for rid, prompt in enumerate(cases, start=1):
        assert_equal(run, rid, hf_generate(gemma3, prompt, MAX_NEW))


def test_gemma3_on_the_triton_kernels_equals_transformers(gemma3: Path) -> None:
    """The varlen prefill kernel with the images' spans (and the decode kernel), under
    TRITON_INTERPRET=1 on CPU: transformers' tokens and logprobs."""
    engine = build_engine(gemma3, attention="triton")
    prompt = gemma3_prompt(gemma3, [picture((30, 60), 2), "and", picture((50, 50), 3), "so"])
    assert_equal(served(engine, [prompt]), 1, hf_generate(gemma3, prompt, MAX_NEW))


@pytest.mark.parametrize("family", ["paligemma", "gemma3"])
def test_two_images_give_different_outputs(request: pytest.FixtureRequest, family: str) -> None:
    path: Path = request.getfixturevalue(family)
    engine = build_engine(path)
    if family == "paligemma":
        a, b = (paligemma_prompt(path, "What is this?", [picture((40, 30), s)]) for s in (4, 5))
    else:
        a, b = (gemma3_prompt(path, ["Look", picture((40, 30), s)]) for s in (4, 5))
    assert a.ids == b.ids
    run = served(engine, [a, b])
    assert (run.tokens[1], run.logprobs[1]) != (run.tokens[2], run.logprobs[2])
    assert run.tokens[1] != run.tokens[2] or max(
        abs(x - y) for x, y in zip(run.logprobs[1], run.logprobs[2], strict=True)) > 1e-2


def test_gemma3_chunks_around_images_give_the_whole_prefill(gemma3: Path) -> None:
    """Chunks ending only outside the images (the router's rule), mixed with the other
    request's decode steps: transformers' tokens."""
    engine = build_engine(gemma3)
    engine.clear(None)
    prompt = gemma3_prompt(gemma3, ["Look", picture((40, 30), 1), "and",
                                    picture((30, 40), 2), "what?"])
    expected = hf_generate(gemma3, prompt, MAX_NEW)
    r = request(1, prompt.ids, max_new=MAX_NEW, blocks=[], images=wire_images(prompt))
    cuts = [0]
    for offset, count in prompt.spans:
        cuts += [offset - 1, offset + count]
    cuts.append(len(prompt.ids))
    router = Router(engine)
    batch_id = itertools.count(1).__next__
    for start, end in itertools.pairwise(cuts):
        router.prefill(batch_id(), [router.chunk(r, start, end - start)])
    router.finish()
    assert_equal(router.run, 1, expected)


def test_a_chunk_splitting_a_span_is_refused(gemma3: Path) -> None:
    engine = build_engine(gemma3)
    engine.clear(None)
    prompt = gemma3_prompt(gemma3, ["Look", picture((40, 30), 1), "what?"])
    offset, _ = prompt.spans[0]
    r = request(1, prompt.ids, max_new=MAX_NEW, blocks=[], images=wire_images(prompt))
    router = Router(engine)
    with pytest.raises(InvalidRequest, match="splits a bidirectional span"):
        router.prefill(1, [router.chunk(r, 0, offset + 2)])


def test_wrong_image_shapes_are_refused_in_one_line(paligemma: Path) -> None:
    engine = build_engine(paligemma)
    engine.clear(None)
    prompt = paligemma_prompt(paligemma, "What is this?", [picture((40, 30), 1)])
    r = request(1, prompt.ids, max_new=MAX_NEW, blocks=[], images=wire_images(prompt))
    r.images[0].shape[:] = [3, 16, 64]
    with pytest.raises(InvalidRequest, match=r"not float32 \[3, 32, 32\]"):
        reference_run(engine, [r])
    r = request(1, prompt.ids, max_new=MAX_NEW, blocks=[], images=wire_images(prompt))
    r.images[0].token_count = 15
    with pytest.raises(InvalidRequest, match="take 16"):
        reference_run(engine, [r])




def test_a_prefix_cache_hit_inside_the_paligemma_prefix_gives_the_cold_tokens(
    paligemma: Path
) -> None:
    """The same prompt again, its first blocks (inside the prompt's one span) from the cache:
    the chunk computes the rest of the span over the cached keys, with no pixels sent (the
    router keys a span's blocks by the whole span, so only an identical prompt gets here)."""
    engine = build_engine(paligemma)
    prompt = paligemma_prompt(paligemma, "What is this?", [picture((40, 30), 1)])
    cold = served(engine, [prompt])
    cache_len = 5 * BLOCK
    assert 16 < cache_len < len(prompt.ids)  # past the image, inside the prompt
    total = len(prompt.ids) + MAX_NEW
    shared = cache_len // BLOCK
    r = request(2, prompt.ids, max_new=MAX_NEW, blocks=[], images=wire_images(prompt),
                cache_len=cache_len)
    r.blocks[:] = list(range(1, 1 + shared)) + list(range(40, 40 + -(-total // BLOCK) - shared))
    for image in r.images:
        image.ClearField("pixel_values")
        image.ClearField("shape")
    warm = Run(engine)
    warm.finish(warm.prefill(pb.Batch(id=2, requests=[r])))
    assert warm.tokens[2] == cold.tokens[1]
    torch.testing.assert_close(warm.logprobs[2], cold.logprobs[1], rtol=TOL, atol=TOL)

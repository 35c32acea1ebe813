"""Qwen2-VL served by the shard's Engine against transformers' Qwen2VLForConditionalGeneration
.generate on the same tiny random weights and processed images: greedy tokens equal, logprobs
within 1e-3, whole or in chunks that split an image (pixel values only with the chunks that
compute its tokens, as the router sends them), after a prefix-cache hit past an image, mixed
into another request's decode steps, resumed after preemption, and on two gloo ranks."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.engine.engine import Engine
from pytgi_shard.errors import InvalidRequest
from pytgi_shard.service.startup import load_engine
from pytgi_shard.settings import ShardSettings
from tests.unit.shard.engine.test_engine import Run
from tests.unit.shard.models.qwen2_vl.vlm_cases import (
    Prompt,
    hf_generate,
    picture,
    process,
    prompt_with,
    wire_images,
)
from tests.unit.shard.models.test_models import _free_port
from tests.unit.shard.router_steps import BLOCK, Router, build_engine, reference_run, request
from tests.vision_models import write_qwen2_vl_model

MAX_NEW = 6
TOL = 1e-3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen2_vl_model(tmp_path_factory.mktemp("qwen2_vl"))


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
    assert_run(run, 2, hf_generate(model_dir, blue, MAX_NEW))


def as_router_sends(r: pb.Request) -> pb.Request:
    """Pixel values only for the images whose tokens the chunk computes (batch_wire)."""
    end = r.cache_len + r.chunk_len if r.chunk_len else len(r.input_ids) + len(r.generated_ids)
    for image in r.images:
        if not (image.token_offset < end and r.cache_len < image.token_offset
                + image.token_count):
            image.ClearField("pixel_values")
            image.ClearField("shape")
    return r


@pytest.mark.parametrize("size", [3, 5, 8])
def test_chunks_splitting_images_give_the_whole_prefill(
    fresh: Engine, model_dir: Path, size: int
) -> None:
    """Two requests, each prefilled in chunks of `size` (the second's chunks mixed into the
    first's decode steps); the tower runs once per image and its output is freed after."""
    a, b = two_images(model_dir), one_image(model_dir, seed=6)
    expected = {1: hf_generate(model_dir, a, MAX_NEW), 2: hf_generate(model_dir, b, MAX_NEW)}
    encoded: list[tuple[int, int, int]] = []
    encode = fresh.model.encode  # type: ignore[attr-defined]

    def counted(pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        encoded.append(grid)
        return encode(pixels, grid)

    fresh.model.encode = counted  # type: ignore[attr-defined]
    try:
        router = Router(fresh)
        batch_id = itertools.count(1).__next__
        for r in (vlm_request(1, a), vlm_request(2, b)):
            start = 0
            while start < len(r.input_ids):
                router.prefill(batch_id(), [as_router_sends(router.chunk(r, start, size))])
                start += size
        router.finish()
    finally:
        del fresh.model.encode  # type: ignore[attr-defined]
    assert len(encoded) == 3
    for rid, want in expected.items():
        assert_run(router.run, rid, want)
    assert len(fresh.model.images) == 0  # type: ignore[attr-defined]


def test_a_prefix_cache_hit_past_the_image_gives_the_cold_tokens(
    fresh: Engine, model_dir: Path
) -> None:
    """B's first blocks are A's (same image and text): B computes only the text after the
    image, its chunk carrying the image's grid and span but no pixels."""
    prompt = one_image(model_dir)
    cold = reference_run(fresh, [vlm_request(1, prompt)])  # A on blocks 1..
    end_of_image = prompt.images[0][0] + prompt.images[0][1].tokens
    cache_len = (end_of_image // BLOCK + 1) * BLOCK
    assert cache_len < len(prompt.ids)
    shared = cache_len // BLOCK
    total = len(prompt.ids) + MAX_NEW
    blocks = list(range(1, 1 + shared)) + list(range(40, 40 + -(-total // BLOCK) - shared))
    b = as_router_sends(vlm_request(2, prompt, cache_len=cache_len))
    b.blocks[:] = blocks
    assert not b.images[0].pixel_values
    warm = Run(fresh)
    warm.finish(warm.prefill(pb.Batch(id=2, requests=[b])))
    assert warm.tokens[2] == cold.tokens[1]
    torch.testing.assert_close(warm.logprobs[2], cold.logprobs[1], rtol=TOL, atol=TOL)


def test_a_resumed_request_continues_at_its_rope_delta(fresh: Engine, model_dir: Path) -> None:
    prompt = one_image(model_dir)
    tokens, logprobs = hf_generate(model_dir, prompt, MAX_NEW)
    r = vlm_request(1, prompt)
    r.generated_ids[:] = tokens[:2]
    run = reference_run(fresh, [r])
    assert_run(run, 1, (tokens[2:], logprobs[2:]))


def test_bad_images_are_refused_in_one_line(fresh: Engine, model_dir: Path) -> None:
    prompt = one_image(model_dir)
    r = vlm_request(1, prompt)
    r.images[0].grid[:] = [1, 4, 8]
    with pytest.raises(InvalidRequest, match="grid \\[1, 4, 8\\] gives 8 tokens, not 6"):
        reference_run(fresh, [r])
    r = vlm_request(1, prompt)
    r.images[0].token_offset = len(prompt.ids) - 2
    with pytest.raises(InvalidRequest, match="end past the prompt"):
        reference_run(fresh, [r])
    r = vlm_request(1, prompt)
    r.images[0].shape[:] = [5, 1176]
    with pytest.raises(InvalidRequest, match="are not float32"):
        reference_run(fresh, [r])


def _rank_main(rank: int, port: int, model: Path, out: Path) -> None:
    torch.set_num_threads(1)
    settings = ShardSettings(model_path=model, block_size=BLOCK, rank=rank, world_size=2,
                             master_port=port)
    engine = load_engine(settings)
    try:
        engine.warmup(pb.WarmupRequest(max_batch_total_tokens=1024))
        router = Router(engine)
        r = vlm_request(1, two_images(model))
        for start in range(0, len(r.input_ids), 7):
            router.prefill(start + 1, [as_router_sends(router.chunk(r, start, 7))])
        router.finish()
        torch.save((router.run.tokens, router.run.logprobs), out / f"rank{rank}.pt")
    finally:
        engine.dist.close()


def test_two_ranks_serve_the_transformers_tokens(model_dir: Path, tmp_path: Path) -> None:
    mp.spawn(_rank_main, args=(_free_port(), model_dir, tmp_path), nprocs=2, join=True)
    tokens, logprobs = hf_generate(model_dir, two_images(model_dir), MAX_NEW)
    for rank in range(2):
        got_tokens, got_logprobs = torch.load(tmp_path / f"rank{rank}.pt")
        assert got_tokens[1] == tokens
        torch.testing.assert_close(got_logprobs[1], logprobs, rtol=TOL, atol=TOL)


def test_decode_through_the_graph_runner_keeps_each_rows_rope_delta(
    fresh: Engine, model_dir: Path
) -> None:
    """The decode graphs' buffers (padded buckets, run eagerly on the CPU) carry the 1-D
    positions with each row's rope delta: image and text rows decode as transformers."""
    from pytgi_shard.engine.decode_graphs import DecodeGraphRunner

    prompts = [one_image(model_dir, seed=7), two_images(model_dir),
               prompt_with(model_dir, [[40, 41, 42]])]
    expected = [hf_generate(model_dir, p, MAX_NEW) for p in prompts]
    fresh.runner.decode_graphs = DecodeGraphRunner(
        fresh.model, (1, 2, 4), 16, BLOCK, pad_eagerly=True)
    try:
        assert fresh.model.graph_capturable
        run = Run(fresh)
        reqs = [vlm_request(i + 1, p) for i, p in enumerate(prompts)]
        for i, r in enumerate(reqs):
            r.blocks[:] = list(range(1 + 12 * i, 13 + 12 * i))
        run.finish(run.prefill(pb.Batch(id=1, requests=reqs)))
    finally:
        fresh.runner.decode_graphs = None
    for i, want in enumerate(expected):
        assert_run(run, i + 1, want)


@pytest.fixture(scope="module")
def qwen2_5_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen2_vl_model(tmp_path_factory.mktemp("qwen2_5_vl"), family="qwen2_5_vl")


def test_qwen2_5_vl_whole_and_in_chunks_equals_transformers(qwen2_5_vl: Path) -> None:
    """Qwen2.5-VL (windowed tower, the same M-RoPE decoder): whole, and in chunks of 5 that
    split both images."""
    engine = build_engine(qwen2_5_vl)
    assert engine.model.model_type == "qwen2_5_vl"
    a, b = two_images(qwen2_5_vl), one_image(qwen2_5_vl, seed=8)
    expected = {1: hf_generate(qwen2_5_vl, a, MAX_NEW), 2: hf_generate(qwen2_5_vl, b, MAX_NEW)}
    whole = reference_run(engine, [vlm_request(1, a), vlm_request(2, b)])
    engine.clear(None)
    router = Router(engine)
    batch_id = itertools.count(1).__next__
    for r in (vlm_request(1, a), vlm_request(2, b)):
        for start in range(0, len(r.input_ids), 5):
            router.prefill(batch_id(), [as_router_sends(router.chunk(r, start, 5))])
    router.finish()
    for rid, want in expected.items():
        assert_run(whole, rid, want)
        assert_run(router.run, rid, want)


def test_warmup_encodes_the_processors_largest_image(fresh: Engine) -> None:
    """Warmup's peak (the KV cache's sizing) includes the tower on the largest image the
    checkpoint's processor gives (max_pixels 28 * 28 * 16: a 4 x 4 merged square)."""
    model = fresh.model
    assert model.largest_grid() == (1, 8, 8)  # type: ignore[attr-defined]
    grids: list[tuple[int, int, int]] = []
    encode = model.encode  # type: ignore[attr-defined]

    def counted(pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        grids.append(grid)
        return encode(pixels, grid)

    model.encode = counted  # type: ignore[attr-defined]
    try:
        fresh.warmup(pb.WarmupRequest(max_prefill_tokens=128, max_batch_total_tokens=2048))
    finally:
        del model.encode  # type: ignore[attr-defined]
    assert grids == [(1, 8, 8)]

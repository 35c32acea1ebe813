"""Qwen2-VL's vision tower and M-RoPE positions against transformers' on the same tiny weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pytgi_shard.device.distributed import single_process
from pytgi_shard.models import ModelConfig
from pytgi_shard.models.qwen2_vl.mrope import ImageSpan, mrope_positions, rope_delta
from pytgi_shard.models.qwen2_vl.vision import VisionConfig, VisionTower
from pytgi_shard.weights.reader import Weights
from tests.unit.shard.models.qwen2_vl.vlm_cases import picture, process
from tests.vision_models import write_qwen2_vl_model


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen2_vl_model(tmp_path_factory.mktemp("qwen2_vl"), max_pixels=28 * 28 * 64)


@pytest.fixture(scope="module")
def qwen2_5_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen2_vl_model(tmp_path_factory.mktemp("qwen2_5_vl"), max_pixels=28 * 28 * 64,
                                family="qwen2_5_vl")


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("size", [(60, 40), (40, 100), (112, 112), (200, 90)])
def test_tower_equals_transformers_visual(
    request: pytest.FixtureRequest, family: str, size: tuple[int, int]
) -> None:
    """Qwen2.5-VL's windows (2 x 2 merged tokens) cut these images into whole and edge ones."""
    from transformers import AutoModelForImageTextToText

    path: Path = request.getfixturevalue(family)
    image = process(path, picture(size, seed=sum(size)))
    hf = AutoModelForImageTextToText.from_pretrained(path, torch_dtype=torch.float32)
    with torch.no_grad():
        expected = hf.model.get_image_features(
            image.pixel_values, torch.tensor([list(image.grid)])).pooler_output[0]
    config = ModelConfig.read(path)
    weights = Weights(path, torch.float32, single_process(torch.device("cpu")))
    tower = VisionTower(weights, "visual", VisionConfig(config.raw["vision_config"],
                                                        windowed=family == "qwen2_5_vl"))
    got = tower(image.pixel_values, image.grid)
    assert got.shape == (image.tokens, 64)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_tower_refuses_pixels_that_do_not_fit_the_grid(qwen2_vl: Path) -> None:
    config = ModelConfig.read(qwen2_vl)
    weights = Weights(qwen2_vl, torch.float32, single_process(torch.device("cpu")))
    tower = VisionTower(weights, "visual", VisionConfig(config.raw["vision_config"]))
    with pytest.raises(ValueError, match="for a grid"):
        tower(torch.zeros(8, 1176), (1, 4, 4))


def _hf_rope_index(ids: list[int], types: list[int], grids: list[list[int]]
                   ) -> tuple[torch.Tensor, int]:
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    model = Qwen2VLModel.__new__(Qwen2VLModel)
    model.config = Qwen2VLConfig()
    pos, delta = model.get_rope_index(torch.tensor([ids]), torch.tensor([types]),
                                      torch.tensor(grids))
    return pos[:, 0], int(delta)


def test_mrope_positions_equal_get_rope_index_over_any_range() -> None:
    # 3 text tokens, an image of 2 x 3 merged tokens, 2 text, one of 4 x 2, 5 text.
    ids = [1, 2, 3] + [9] * 6 + [4, 5] + [9] * 8 + [1] * 5
    types = [0, 0, 0] + [1] * 6 + [0, 0] + [1] * 8 + [0] * 5
    expected, delta = _hf_rope_index(ids, types, [[1, 4, 6], [1, 8, 4]])
    spans = [ImageSpan(3, 6, (1, 2, 3)), ImageSpan(11, 8, (1, 4, 2))]
    assert torch.equal(mrope_positions(spans, 0, len(ids)), expected)
    assert rope_delta(spans, len(ids)) == delta == -7
    for start in range(len(ids)):
        for end in range(start + 1, len(ids) + 1):
            assert torch.equal(mrope_positions(spans, start, end), expected[:, start:end])
    # Past the prompt (generated tokens): index + rope delta on the three axes.
    after = mrope_positions(spans, len(ids), len(ids) + 3)
    assert torch.equal(after, torch.arange(len(ids), len(ids) + 3).repeat(3, 1) + delta)
    # No image: plain positions.
    assert torch.equal(mrope_positions([], 2, 5), torch.arange(2, 5).repeat(3, 1))

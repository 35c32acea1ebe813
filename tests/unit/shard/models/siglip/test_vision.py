"""SigLIP's tower and PaliGemma's / Gemma 3's projectors against transformers'
get_image_features on the same tiny random weights and the processor's pixel values."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pytgi_shard.device.distributed import single_process
from pytgi_shard.models.siglip.projectors import Gemma3Projector, PaliGemmaProjector
from pytgi_shard.models.siglip.vision import (
    SiglipConfig,
    SiglipVisionTower,
    image_patches,
    siglip_prefix,
)
from pytgi_shard.weights.reader import Weights
from tests.siglip_models import (
    GEMMA3_MM_TOKENS,
    load_processor,
    write_gemma3_model,
    write_paligemma_model,
)


def picture(size: tuple[int, int], seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def paligemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_paligemma_model(tmp_path_factory.mktemp("paligemma"))


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gemma3_model(tmp_path_factory.mktemp("gemma3"))


def _reference(path: Path, image: Image.Image) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' pixel values [3, H, W] and image features [tokens, text hidden]."""
    from transformers import AutoModelForImageTextToText

    pixels = load_processor(path).image_processor(image, return_tensors="pt")["pixel_values"]
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        features = hf.model.get_image_features(pixels).pooler_output
    return pixels[0], features[0]


def _tower(path: Path) -> tuple[Weights, SiglipVisionTower]:
    from pytgi_shard.models import ModelConfig

    config = ModelConfig.read(path)
    weights = Weights(path, torch.float32, single_process(torch.device("cpu")))
    vision = SiglipConfig.from_dict(config.raw["vision_config"])
    return weights, SiglipVisionTower(weights, siglip_prefix(weights, "vision_tower"), vision)


@pytest.mark.parametrize("size", [(32, 32), (50, 20), (17, 90)])
def test_paligemma_tower_and_projector_equal_transformers(paligemma: Path,
                                                         size: tuple[int, int]) -> None:
    pixels, expected = _reference(paligemma, picture(size, seed=sum(size)))
    weights, tower = _tower(paligemma)
    projector = PaliGemmaProjector(weights, "multi_modal_projector")
    got = projector(tower(image_patches(pixels, 8)))
    assert got.shape == (16, 64)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("size", [(32, 32), (64, 30)])
def test_gemma3_tower_and_projector_equal_transformers(gemma3: Path,
                                                      size: tuple[int, int]) -> None:
    pixels, expected = _reference(gemma3, picture(size, seed=sum(size)))
    weights, tower = _tower(gemma3)
    projector = Gemma3Projector(weights, "multi_modal_projector", 4, GEMMA3_MM_TOKENS, 1e-6)
    got = projector(tower(image_patches(pixels, 8)))
    assert got.shape == (GEMMA3_MM_TOKENS, 64)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_tower_refuses_pixels_of_another_size(paligemma: Path) -> None:
    _, tower = _tower(paligemma)
    with pytest.raises(ValueError, match=r"takes \[16, 192\]"):
        tower(torch.zeros(9, 192))

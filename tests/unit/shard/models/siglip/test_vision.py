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


def test_hub_configs_read_as_transformers_defaults() -> None:
    """config.json as google/gemma-3-4b-it and google/paligemma-3b-pt-224 ship it (transformers
    4's layout, most text keys left to the defaults)."""
    from pytgi_shard.models.siglip.model import text_config

    gemma3 = {"model_type": "gemma3", "mm_tokens_per_image": 256, "text_config": {
        "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024}}
    decoder = text_config(gemma3, "gemma3_text")
    assert (decoder.num_attention_heads, decoder.num_key_value_heads, decoder.head_dim) == (8, 4,
                                                                                         256)
    assert decoder.layer_windows[:6] == (1024,) * 5 + (None,)
    assert decoder.local_rope_theta == 10000.0
    paligemma = {"model_type": "paligemma", "text_config": {
        "hidden_size": 2048, "intermediate_size": 16384, "model_type": "gemma",
        "num_attention_heads": 8, "num_hidden_layers": 18, "num_image_tokens": 256,
        "num_key_value_heads": 1, "vocab_size": 257216}}
    decoder = text_config(paligemma, "gemma")
    assert (decoder.head_dim, decoder.num_key_value_heads, decoder.model_type) == (256, 1,
                                                                                 "gemma")
    vision = SiglipConfig.from_dict({"hidden_size": 1152, "intermediate_size": 4304,
                                     "num_attention_heads": 16, "num_hidden_layers": 27,
                                     "patch_size": 14, "projection_dim": 2048})
    assert (vision.image_size, vision.num_patches, vision.patch_dim) == (224, 256, 588)
    with pytest.raises(ValueError, match="only gemma, gemma2, gemma3_text"):
        text_config({"model_type": "paligemma", "text_config": {"model_type": "llama"}}, "gemma")

"""LLaVA-NeXT's image processor, router half: its anyres port equals transformers'
LlavaNextImageProcessorPil (pixel values, 1e-5) and LlavaNextProcessor's image token counts on
images of several shapes, at the Hub checkpoints' settings (336-pixel tiles, the default
pinpoints, 14-pixel patches) and the tiny test model's; LLaVA 1.5's one-tile processor the same
way; the family's prompt rendering."""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from tokenizers import Tokenizer

from pytgi_router.http.media.decode import decode_image
from pytgi_router.http.media.llava_next import LlavaNextImageProcessor
from pytgi_router.http.media.markdown import markdown_images
from pytgi_router.http.media.source import ImageRef
from pytgi_router.http.media.vision_model import image_support
from tests.vision_checkpoints import (
    LLAVA_IMAGE_TOKEN,
    LLAVA_PATCH,
    LLAVA_TILE,
    llava_next_processor,
    llava_processor,
    write_llava_next_tokenizer,
)

SIZES = [(70, 50), (41, 300), (800, 1000), (20, 20), (1000, 200), (336, 672), (500, 499),
         (300, 2), (3, 900)]


def noise(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((height, width, 3)) * 255).astype("uint8"))


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def transformers_tokens(theirs: Any, patch: int, height: int, width: int) -> int:
    """LlavaNextProcessor's count for an image of this size (class token dropped)."""
    from transformers import LlavaNextProcessor, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(
        '{"version":"1.0","model":{"type":"WordLevel","vocab":{"<image>":0,"[UNK]":1},'
        '"unk_token":"[UNK]"}}'))
    processor = LlavaNextProcessor(image_processor=theirs, tokenizer=tok, patch_size=patch,
                                   vision_feature_select_strategy="default",
                                   num_additional_image_tokens=1)
    return int(processor._get_num_multimodal_tokens([(height, width)]).num_image_tokens[0])


def hub_like() -> tuple[Any, dict[str, Any], int]:
    from transformers.models.llava_next.image_processing_pil_llava_next import (
        LlavaNextImageProcessorPil,
    )
    theirs = LlavaNextImageProcessorPil(size={"shortest_edge": 336},
                                        crop_size={"height": 336, "width": 336})
    return theirs, theirs.to_dict(), 14


def tiny() -> tuple[Any, dict[str, Any], int]:
    theirs = llava_next_processor()
    return theirs, theirs.to_dict(), LLAVA_PATCH


@pytest.mark.parametrize("settings", [hub_like, tiny], ids=["hub-336", "tiny-32"])
@pytest.mark.parametrize(("width", "height"), SIZES)
def test_processor_equals_transformers(settings: Any, width: int, height: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs, pre, patch = settings()
    ours = LlavaNextImageProcessor.from_checkpoint({"vision_config": {"patch_size": patch}},
                                                   json.loads(json.dumps(pre)))
    decoded = decode_image(png(noise(width, height)), "x", 1 << 25)
    expected = theirs(images=[decoded.image], return_tensors="np")
    got = ours.process(decoded)
    assert got.pixel_values.dtype == np.float32
    assert got.pixel_values.shape == expected["pixel_values"][0].shape
    np.testing.assert_allclose(got.pixel_values, expected["pixel_values"][0], atol=1e-5)
    assert list(got.grid) == expected["image_sizes"][0].tolist() == [height, width]
    assert got.tokens == transformers_tokens(theirs, patch, height, width)
    assert got.tokens == ours.tokens(height, width)


def test_a_full_strategy_checkpoint_is_refused_at_start_up(tmp_path: Path) -> None:
    tok = write_llava_next_tokenizer(tmp_path)
    pre = json.loads((tmp_path / "preprocessor_config.json").read_text())
    support = image_support({"model_type": "llava_next",
                             "vision_feature_select_strategy": "full"}, pre, tok)
    assert support.vision is None and "vision_feature_select_strategy 'full'" in support.why_not


def test_prompts_carry_image_tokens_as_llava_next_does(tmp_path: Path) -> None:
    tok = write_llava_next_tokenizer(tmp_path)
    pre = json.loads((tmp_path / "preprocessor_config.json").read_text())
    config = {"model_type": "llava_next", "vision_config": {"patch_size": LLAVA_PATCH,
                                                            "image_size": LLAVA_TILE}}
    support = image_support(config, pre, tok)
    vision = support.vision
    assert vision is not None, support.why_not
    assert support.describe() == "images: prepared for llava_next (its image processor)"
    assert vision.image_token_id == tok.token_to_id(LLAVA_IMAGE_TOKEN)
    # /generate: TGI renders a markdown image as the image tokens alone.
    found = markdown_images("look ![](data:a) and ![](data:b) then")
    assert vision.markdown_text(found, [2, 3]) == (
        "look <image><image> and <image><image><image> then")
    # chat: the template's one <image> per image part, repeated once per image token.
    refs = [ImageRef("messages[0].content[0]", "data:a")]
    assert vision.chat_text("[INST] <image>\nhi [/INST]", refs, [3]) == (
        "[INST] <image><image><image>\nhi [/INST]")


@pytest.mark.parametrize("tile", [336, LLAVA_TILE])
@pytest.mark.parametrize(("width", "height"), [(70, 50), (41, 300), (800, 1000), (300, 2)])
def test_llava_1_5_processor_equals_transformers(tile: int, width: int, height: int) -> None:
    """LLaVA 1.5 (`llava`): one center-cropped tile, (tile / patch)^2 tokens, as
    LlavaImageProcessorPil and LlavaProcessor make them."""
    from transformers import LlavaProcessor, PreTrainedTokenizerFast

    patch = 14 if tile == 336 else LLAVA_PATCH
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = llava_processor(tile)
    ours = LlavaNextImageProcessor.llava({"vision_config": {"patch_size": patch}},
                                         json.loads(json.dumps(theirs.to_dict())))
    decoded = decode_image(png(noise(width, height)), "x", 1 << 25)
    expected = theirs(images=[decoded.image], return_tensors="np")["pixel_values"]
    got = ours.process(decoded)
    assert got.pixel_values.shape == expected.shape == (1, 3, tile, tile)
    np.testing.assert_allclose(got.pixel_values, expected, atol=1e-5)
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(
        '{"version":"1.0","model":{"type":"WordLevel","vocab":{"<image>":0,"[UNK]":1},'
        '"unk_token":"[UNK]"}}'))
    processor = LlavaProcessor(image_processor=theirs, tokenizer=tok, patch_size=patch,
                               vision_feature_select_strategy="default",
                               num_additional_image_tokens=1)
    counted = processor.replace_image_token({"pixel_values": expected}, 0).count("<image>")
    assert got.tokens == counted == (tile // patch) ** 2

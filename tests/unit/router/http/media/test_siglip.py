"""PaliGemma's and Gemma 3's images, the router's half: the fixed-size processors equal
transformers' (SiglipImageProcessorPil, Gemma3ImageProcessorPil) on images of several sizes, and
validated prompts hold the token ids transformers' processors make (PaliGemmaProcessor's image
tokens + <bos> + text + "\\n"; Gemma 3's chat template and boi/soft/eoi tokens), with their
bidirectional spans."""

from __future__ import annotations

import asyncio
import io
import json
import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from tokenizers import Tokenizer

from pytgi_router.http.media.decode import decode_image
from pytgi_router.http.media.intake import ImageIntake
from pytgi_router.http.media.limits import MediaLimits
from pytgi_router.http.media.prepare import ImagePreparer
from pytgi_router.http.media.siglip import FixedSizeImageProcessor
from pytgi_router.http.media.vision_model import ImageSupport, image_support
from pytgi_router.http.openai.chat_template import ChatTemplate
from pytgi_router.http.openai.schemas import parse_chat
from pytgi_router.http.schemas import GenerateParameters, GenerateRequest
from pytgi_router.http.validation import ValidationLimits, Validator
from tests.siglip_models import load_processor, write_gemma3_model, write_paligemma_model
from tests.unit.router.http.media.images import data_uri


@pytest.fixture(scope="module")
def paligemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_paligemma_model(tmp_path_factory.mktemp("paligemma"))


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gemma3_model(tmp_path_factory.mktemp("gemma3"))


def read(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def support(path: Path) -> tuple[ImageSupport, Tokenizer]:
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    return image_support(read(path / "config.json"), read(path / "preprocessor_config.json"),
                         tok), tok


def noise(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


@pytest.mark.parametrize("family", ["paligemma", "gemma3"])
@pytest.mark.parametrize("size", [(32, 32), (50, 20), (17, 90), (640, 480)])
def test_processor_equals_transformers(request: pytest.FixtureRequest, family: str,
                                       size: tuple[int, int]) -> None:
    path: Path = request.getfixturevalue(family)
    images, _ = support(path)
    assert images.vision is not None, images.why_not
    image = noise(*size, seed=sum(size))
    decoded = decode_image(png(image), "x", 1 << 25)
    ours = images.vision.processor.process(decoded)
    theirs = load_processor(path).image_processor(image, return_tensors="np")["pixel_values"][0]
    assert ours.pixel_values.shape == theirs.shape == (3, 32, 32)
    np.testing.assert_allclose(ours.pixel_values, theirs, atol=1e-5, rtol=0)
    assert ours.grid == () and ours.tokens == (16 if family == "paligemma" else 4)


def test_hub_preprocessor_configs_read_as_transformers_defaults() -> None:
    """PaliGemma's (bicubic, 224) and Gemma 3's (bilinear, 896) as their Hub files say."""
    pali = FixedSizeImageProcessor.from_config(
        {"size": {"height": 224, "width": 224}, "resample": 3, "image_mean": [0.5] * 3,
         "image_std": [0.5] * 3, "image_seq_length": 256}, 256, 3)
    assert (pali.height, pali.resample, pali.tokens) == (224, 3, 256)
    gemma = FixedSizeImageProcessor.from_config({"size": {"height": 896, "width": 896}}, 256, 2)
    assert (gemma.width, gemma.resample) == (896, 2)


def test_pan_and_scan_is_refused_at_start_up(gemma3: Path) -> None:
    tok = Tokenizer.from_file(str(gemma3 / "tokenizer.json"))
    pre = {**read(gemma3 / "preprocessor_config.json"), "do_pan_and_scan": True}
    images = image_support(read(gemma3 / "config.json"), pre, tok)
    assert images.vision is None and "pan-and-scan" in images.why_not


def validator(path: Path) -> Validator:
    images, tok = support(path)
    assert images.vision is not None
    v = Validator(tok, ValidationLimits(2, 4, 5, 400, 512), rng=random.Random(1))
    v.images = ImagePreparer(images.vision, ImageIntake(MediaLimits()))  # type: ignore[arg-type]
    return v


def test_paligemma_generate_prompt_is_the_processors(paligemma: Path) -> None:
    """A markdown image where PaliGemma's <image> goes: image tokens, <bos>, text, "\\n";
    two images' tokens adjacent; the whole prompt one bidirectional span."""
    v = validator(paligemma)
    processor = load_processor(paligemma)
    a, b = noise(40, 30, 1), noise(20, 50, 2)
    req = GenerateRequest(f"![]({data_uri(png(a))})![]({data_uri(png(b))})caption en",
                          GenerateParameters(max_new_tokens=4))
    valid = asyncio.run(v.validate(req)).request
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = processor(images=[[a, b]], text=["<image><image>caption en"])["input_ids"][0]
    assert valid.input_ids == list(theirs)
    assert [(i.token_offset, i.token_count) for i in valid.images] == [(0, 16), (16, 16)]
    assert valid.noncausal_spans == ((0, len(theirs)),)
    # Text only: the prompt is still PaliGemma's prefix.
    text = asyncio.run(v.validate(GenerateRequest("hello", GenerateParameters(max_new_tokens=2))))
    assert text.request.noncausal_spans == ((0, len(text.request.input_ids)),)


def test_paligemma_chat_prompt_is_the_processors(paligemma: Path) -> None:
    v = validator(paligemma)
    template = ChatTemplate(read(paligemma / "tokenizer_config.json")["chat_template"])
    image = noise(60, 40, 3)
    chat = parse_chat({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_uri(png(image))}},
        {"type": "text", "text": "What is this?"}]}]})
    prompt = template.apply(chat.messages)
    req = GenerateRequest(prompt, GenerateParameters(max_new_tokens=4), add_special_tokens=False,
                          images=chat.images)
    valid = asyncio.run(v.validate(req)).request
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = load_processor(paligemma)(images=[[image]], text=[prompt])["input_ids"][0]
    assert valid.input_ids == list(theirs)


def test_gemma3_chat_and_generate_prompts_are_the_processors(gemma3: Path) -> None:
    """The chat template's <start_of_image> expanded as Gemma3Processor does; each image's
    soft tokens one bidirectional span; a markdown image the same image text."""
    v = validator(gemma3)
    processor = load_processor(gemma3)
    config = read(gemma3 / "tokenizer_config.json")
    template = ChatTemplate(config["chat_template"], bos_token=config["bos_token"])
    a, b = noise(40, 30, 4), noise(30, 40, 5)
    chat = parse_chat({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Look"},
        {"type": "image_url", "image_url": {"url": data_uri(png(a))}},
        {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": data_uri(png(b))}}]}]})
    prompt = template.apply(chat.messages)
    req = GenerateRequest(prompt, GenerateParameters(max_new_tokens=4), add_special_tokens=False,
                          images=chat.images)
    valid = asyncio.run(v.validate(req)).request
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = processor(images=[[a, b]], text=[prompt], add_special_tokens=False)
    assert valid.input_ids == list(out["input_ids"][0])
    soft = [i for i, t in enumerate(out["token_type_ids"][0]) if t == 1]
    assert valid.noncausal_spans == ((soft[0], soft[0] + 4), (soft[4], soft[4] + 4))
    markdown = asyncio.run(v.validate(GenerateRequest(
        f"Look ![]({data_uri(png(a))}) here", GenerateParameters(max_new_tokens=4)))).request
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = processor(images=[[a]], text=["Look <start_of_image> here"],
                           add_special_tokens=False)["input_ids"][0]
    assert markdown.input_ids == list(theirs)

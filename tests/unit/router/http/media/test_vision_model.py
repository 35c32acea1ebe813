"""The model side, router half: which checkpoints take images, Qwen2-VL's image processor equal
to transformers' (PIL backend) on the same images, and a vision-language request validated into
image tokens that count in its budget and wire messages that say where they are."""

from __future__ import annotations

import asyncio
import io
import json
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from tokenizers import Tokenizer

from pytgi_router.http.media.decode import decode_image
from pytgi_router.http.media.errors import ImageError, ImagesNotAccepted
from pytgi_router.http.media.intake import ImageIntake
from pytgi_router.http.media.limits import MediaLimits
from pytgi_router.http.media.prepare import ImagePreparer
from pytgi_router.http.media.qwen2_vl import Qwen2VLImageProcessor
from pytgi_router.http.media.source import ImageRef
from pytgi_router.http.media.vision_model import image_support
from pytgi_router.http.openai.chat_template import ChatTemplate
from pytgi_router.http.openai.schemas import parse_chat
from pytgi_router.http.schemas import GenerateParameters, GenerateRequest
from pytgi_router.http.validation import ValidationLimits, Validator
from tests.unit.router.http.media.images import data_uri, encoded
from tests.vision_checkpoints import MAX_PIXELS, write_qwen2_vl_router_files


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen2_vl_router_files(tmp_path_factory.mktemp("qwen2_vl"))


def read(path: Path) -> dict:
    return json.loads(path.read_text())


def support(checkpoint: Path):  # type: ignore[no-untyped-def]
    tok = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    return image_support(read(checkpoint / "config.json"),
                         read(checkpoint / "preprocessor_config.json"), tok), tok


def noise(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((height, width, 3)) * 255).astype("uint8"))


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


@pytest.mark.parametrize(("width", "height"), [(70, 50), (41, 300), (800, 1000), (20, 20)])
def test_qwen2_vl_processor_equals_transformers(checkpoint: Path, width: int, height: int) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = Qwen2VLImageProcessorPil.from_pretrained(checkpoint)
    ours = Qwen2VLImageProcessor.from_config(read(checkpoint / "preprocessor_config.json"))
    decoded = decode_image(png(noise(width, height)), "x", 1 << 25)
    expected = theirs(images=[decoded.image], return_tensors="np")
    got = ours.process(decoded)
    assert got.pixel_values.dtype == np.float32
    assert got.pixel_values.shape == expected["pixel_values"].shape
    np.testing.assert_allclose(got.pixel_values, expected["pixel_values"], atol=1e-5)
    assert list(got.grid) == expected["image_grid_thw"][0].tolist()
    t, h, w = got.grid
    assert got.tokens == t * h * w // 4 == ours.tokens("x", width, height)
    assert got.tokens <= MAX_PIXELS // (28 * 28)


def test_a_real_checkpoints_preprocessor_config_is_read() -> None:
    qwen = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14,
            "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5], "image_processor_type": "Qwen2VLImageProcessor"}
    p = Qwen2VLImageProcessor.from_config(qwen)
    assert (p.min_pixels, p.max_pixels, p.image_mean) == (3136, 12845056, (0.5, 0.5, 0.5))
    assert p.tokens("x", 1024, 768) == (1036 // 28) * (784 // 28) or p.tokens("x", 1024, 768) > 0
    with pytest.raises(ImageError, match="aspect ratio"):
        p.tokens("x", 10_000, 20)


def test_which_checkpoints_take_images(checkpoint: Path) -> None:
    images, tok = support(checkpoint)
    assert images.vision is not None and images.vision.model_type == "qwen2_vl"
    assert images.vision.image_token_id == tok.token_to_id("<|image_pad|>")
    for config, why in [({"model_type": "llama"}, "a text-only model"),
                        (None, "a text-only model"),
                        ({"model_type": "mllama"}, "mllama are not prepared")]:
        other = image_support(config, {}, tok)
        assert other.vision is None and why in other.why_not
        with pytest.raises(ImagesNotAccepted, match=rf"model `m` does not accept images "
                                                    rf"\(.*{why}.*`messages\[0\].content\[1\]`"):
            other.refuse_unless_accepted("m", [ImageRef("messages[0].content[1]", "data:")])
        other.refuse_unless_accepted("m", [])
    assert image_support({"model_type": "qwen2_vl"}, None, tok).vision is None


def validator(checkpoint: Path, **limits: object) -> Validator:
    images, tok = support(checkpoint)
    assert images.vision is not None
    v = Validator(tok, ValidationLimits(2, 4, 5, 200, 256), rng=random.Random(1))
    v.images = ImagePreparer(images.vision, ImageIntake(MediaLimits(**limits)))  # type: ignore[arg-type]
    return v


def generate(inputs: str, **params: object) -> GenerateRequest:
    return GenerateRequest(inputs, GenerateParameters(max_new_tokens=4, **params))  # type: ignore[arg-type]


def test_generate_markdown_images_become_image_tokens_with_their_wire_messages(
        checkpoint: Path) -> None:
    v = validator(checkpoint)
    small, tall = png(noise(60, 40, 1)), png(noise(30, 90, 2))
    inputs = f"Look ![]({data_uri(small)}) and ![]({data_uri(tall)}) ok"
    valid = asyncio.run(v.validate(generate(inputs)))
    req = valid.request
    pad = v.images.vision.image_token_id  # type: ignore[union-attr]
    # smart_resize up to min_pixels: 60x40 -> 84x56 (6x4 patches), 30x90 -> 56x112 (4x8); 2x2 merged
    assert [i.token_count for i in req.images] == [6, 8]
    for image in req.images:
        span = req.input_ids[image.token_offset:image.token_offset + image.token_count]
        assert span == [pad] * image.token_count
        assert image.dtype == "float32" and len(image.content_hash) == 16
        assert len(image.pixel_values) == 4 * image.shape[0] * image.shape[1]
        assert image.grid[0] == 1 and image.shape[0] == image.grid[1] * image.grid[2]
    assert req.input_ids.count(pad) == 14
    assert req.images[0].content_hash != req.images[1].content_hash
    # The image tokens count in the budget: the text alone is far shorter.
    assert req.input_length > 14 and req.inputs.startswith("Look ![](data:")


def test_image_tokens_count_against_the_input_limit(checkpoint: Path) -> None:
    v = validator(checkpoint)
    big = data_uri(png(noise(400, 400)))  # 16 tokens each under the fixture's max_pixels
    text = " x" * 40
    assert len(v.tokenizer.encode(text).ids) < 100
    prompt = " ".join(f"![]({big})" for _ in range(8)) + text
    # 8 x (16 image tokens + vision start and end) + the text: over the 200 input tokens.
    with pytest.raises(Exception, match=r"`inputs` must have less than 200 tokens. Given: 232"):
        asyncio.run(v.validate(generate(prompt)))


def test_truncating_into_an_image_is_refused(checkpoint: Path) -> None:
    v = validator(checkpoint)
    image = data_uri(png(noise(60, 40)))
    with pytest.raises(ImageError, match="`truncate` cut into an image"):
        asyncio.run(v.validate(generate(f"![]({image}) then some text", truncate=4)))


def test_refusals_name_the_image(checkpoint: Path) -> None:
    v = validator(checkpoint, max_images=1)
    ok = data_uri(encoded("PNG"))
    with pytest.raises(ImageError, match=r"image `inputs image 1`: a request carries at most 1"):
        asyncio.run(v.validate(generate(f"![]({ok}) ![]({ok})")))
    with pytest.raises(ImageError, match=r"image `inputs image 0`: fetching image URLs is off"):
        asyncio.run(v.validate(generate("![](https://example.com/a.png)")))


def test_chat_images_are_placed_by_the_template(checkpoint: Path) -> None:
    v = validator(checkpoint)
    template = ChatTemplate(read(checkpoint / "tokenizer_config.json")["chat_template"])
    chat = parse_chat({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is "},
        {"type": "image_url", "image_url": {"url": data_uri(png(noise(60, 40)))}},
        {"type": "text", "text": "?"}]}]})
    assert [r.where for r in chat.images] == ["messages[0].content[1]"]
    prompt = template.apply(chat.messages)
    assert prompt.count("<|image_pad|>") == 1
    req = GenerateRequest(prompt, GenerateParameters(max_new_tokens=4), add_special_tokens=False,
                          images=chat.images)
    valid = asyncio.run(v.validate(req)).request
    assert len(valid.images) == 1 and valid.images[0].token_count == 6
    # A template that drops the image is refused, not guessed at.
    req.inputs = prompt.replace("<|image_pad|>", "")
    with pytest.raises(ImageError, match="the chat template placed 0 images for the 1"):
        asyncio.run(v.validate(req))


def test_a_text_model_keeps_generate_markdown_as_text() -> None:
    from tests.vision_checkpoints import vision_tokenizer
    tok = vision_tokenizer()
    v = Validator(tok, ValidationLimits(2, 4, 5, 200, 256))
    valid = asyncio.run(v.validate(generate("see ![](https://example.com/a.png)"))).request
    assert valid.images == () and valid.input_ids == tok.encode(
        "see ![](https://example.com/a.png)").ids
    with pytest.raises(Exception, match="does not accept images"):
        asyncio.run(v.validate(GenerateRequest("x", GenerateParameters(max_new_tokens=2),
                                               images=[ImageRef("messages[0]", "data:")])))

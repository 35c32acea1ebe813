"""Idefics3's image processor and prompt, router half: the port equals transformers'
Idefics3ImageProcessorPil (pixel values, 1e-5; tiles and global image) at the Hub checkpoints'
settings (longest edge 1456, tiles of 364), SmolVLM's (its own image processor class) and the
tiny model's, splitting on and off; the
router's chat and /generate prompts tokenize to Idefics3Processor's input ids; each tile becomes
its own wire image over its run of `<image>` tokens."""

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
from pytgi_router.http.media.idefics3 import Idefics3ImageProcessor
from pytgi_router.http.media.markdown import markdown_images
from pytgi_router.http.media.prepare import PreparedImages
from pytgi_router.http.media.source import ImageRef
from pytgi_router.http.media.vision_model import VisionModel, image_support
from tests.idefics3_models import (
    IDEFICS3_PATCH,
    IDEFICS3_SEQ_LEN,
    IDEFICS3_TILE,
    idefics3_image_processor,
    write_idefics3_model,
)

SIZES = [(70, 50), (41, 300), (800, 1000), (20, 20), (1000, 200), (364, 364), (500, 499),
         (300, 2), (3, 900), (32, 32)]


def noise(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((height, width, 3)) * 255).astype("uint8"))


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module", params=["idefics3", "smolvlm"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_idefics3_model(tmp_path_factory.mktemp(request.param), family=request.param)


def _config(tile: int, patch: int) -> dict[str, Any]:
    return {"model_type": "idefics3", "scale_factor": 2,
            "vision_config": {"image_size": tile, "patch_size": patch}}


@pytest.mark.parametrize("hub", ["idefics3", "smolvlm", ""])
@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize(("width", "height"), SIZES)
def test_processor_equals_transformers(hub: str, split: bool, width: int, height: int) -> None:
    """At Idefics3-8B's settings, SmolVLM-256M's (SmolVLM's image processor; 512-pixel tiles
    of 16-pixel patches, longest edge 2048) and the tiny model's."""
    tile, patch, longest = {"idefics3": (364, 14, 4 * 364), "smolvlm": (512, 16, 2048),
                            "": (IDEFICS3_TILE, IDEFICS3_PATCH, 96)}[hub]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = idefics3_image_processor(longest, tile, smolvlm=hub == "smolvlm",
                                          do_image_splitting=split)
    ours = Idefics3ImageProcessor.from_checkpoint(_config(tile, patch),
                                                  json.loads(json.dumps(theirs.to_dict())))
    decoded = decode_image(png(noise(width, height)), "x", 1 << 25)
    out = theirs(images=[[decoded.image]], return_tensors="np", return_row_col_info=True)
    expected = out["pixel_values"][0]
    got = ours.process(decoded)
    assert got.pixel_values.shape == expected.shape
    assert got.pixel_values.shape[1:] == (3, tile, tile)
    np.testing.assert_allclose(got.pixel_values, expected, atol=1e-5)
    seq = (tile // patch // 2) ** 2
    assert got.runs == (seq,) * expected.shape[0] and got.tokens == seq * expected.shape[0]
    rows, cols = out["rows"][0][0], out["cols"][0][0]
    assert (rows * cols + 1 if rows else 1) == expected.shape[0]
    assert got.text.count("<image>") == got.tokens


def _vision(path: Path, split: bool = True) -> tuple[VisionModel, Tokenizer]:
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    config = json.loads((path / "config.json").read_text())
    pre = json.loads((path / "preprocessor_config.json").read_text())
    pre["do_image_splitting"] = split
    support = image_support(config, pre, tok)
    assert support.vision is not None, support.why_not
    assert support.describe() == (
        f"images: prepared for {config['model_type']} (its image processor)")
    return support.vision, tok


def _transformers_ids(path: Path, text: str, images: list[Image.Image], split: bool
                      ) -> list[int]:
    from transformers import Idefics3Processor

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # SmolVLM's too: SmolVLMProcessor's image prompt is this code (it needs num2words).
        processor = Idefics3Processor.from_pretrained(path)
        out = processor(text=[text], images=[images] if images else None,
                        add_special_tokens=False, do_image_splitting=split)
    return list(out["input_ids"][0])


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("sizes", [[(70, 50)], [(20, 20)], [(41, 300), (1000, 200)]])
def test_prompts_tokenize_as_idefics3_processor(checkpoint: Path, split: bool,
                                                sizes: list[tuple[int, int]]) -> None:
    """Chat (the template's `<image>` per image part) and /generate (markdown images) give
    Idefics3Processor's ids, split into tiles or (do_image_splitting false) each image one
    tile; each tile is one wire image over one run of image tokens."""
    vision, tok = _vision(checkpoint, split)
    images = [noise(w, h, seed=k) for k, (w, h) in enumerate(sizes)]
    decoded = [decode_image(png(im), f"messages[0].content[{k}]", 1 << 25)
               for k, im in enumerate(images)]
    processed = [vision.processor.process(d) for d in decoded]
    counts = [p.tokens for p in processed]
    bodies = [p.text for p in processed]
    template = "User:" + "".join("<image>" for _ in images) + "What?<end_of_utterance>\n"
    refs = [ImageRef(d.where, "data:") for d in decoded]
    chat = vision.chat_text(template, refs, counts, bodies)
    markdown = vision.markdown_text(
        markdown_images("User:" + "".join("![](data:x)" for _ in images) + "What?"),
        counts, bodies)
    for text, reference in [(chat, template),
                            (markdown, "User:" + "<image>" * len(images) + "What?")]:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert ids == _transformers_ids(checkpoint, reference, images, split)
        wire = PreparedImages(text, processed).wire(vision, ids)
        assert len(wire) == sum(len(p.runs) for p in processed)
        assert split or len(wire) == len(images)
        image_id = tok.token_to_id("<image>")
        for image in wire:
            assert image.token_count == IDEFICS3_SEQ_LEN
            assert ids[image.token_offset:image.token_offset + image.token_count] == (
                [image_id] * IDEFICS3_SEQ_LEN)
            assert list(image.shape) == [3, IDEFICS3_TILE, IDEFICS3_TILE]
        assert len({image.content_hash for image in wire}) == len(wire)


def test_tiles_of_another_size_than_the_tower_are_refused(checkpoint: Path) -> None:
    _, tok = _vision(checkpoint)
    pre = json.loads((checkpoint / "preprocessor_config.json").read_text())
    pre["max_image_size"] = {"longest_edge": 64}
    config = json.loads((checkpoint / "config.json").read_text())
    support = image_support(config, pre, tok)
    assert support.vision is None and "max_image_size 64" in support.why_not

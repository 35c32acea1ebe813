"""A tiny Qwen2-VL, its processed images and prompts, and transformers' generate on them: the
oracle the shard's Qwen2-VL tests compare against."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image as PILImage

from pytgi_proto import generate_pb2 as pb
from tests.hf_reference import hf_vlm_greedy

MERGE = 2


@dataclass(frozen=True)
class Processed:
    """One image as the router sends it: pixel values [patches, dim] and its patch grid."""

    pixel_values: torch.Tensor
    grid: tuple[int, int, int]

    @property
    def tokens(self) -> int:
        t, h, w = self.grid
        return t * h * w // MERGE**2


def picture(size: tuple[int, int], seed: int) -> PILImage.Image:
    rng = np.random.default_rng(seed)
    return PILImage.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def process(model_dir: Path, image: PILImage.Image) -> Processed:
    """transformers' own image processor of the checkpoint (the router's equals it)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    out = Qwen2VLImageProcessorPil.from_pretrained(model_dir)(images=[image], return_tensors="pt")
    grid = tuple(int(v) for v in out["image_grid_thw"][0])
    return Processed(out["pixel_values"].float(), grid)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    images: list[tuple[int, Processed]]  # (token offset, image)


def prompt_with(model_dir: Path, parts: list[list[int] | Processed]) -> Prompt:
    """Text ids and images in order; each image as <|vision_start|> image tokens <|vision_end|>."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    start, pad, end = (tok.token_to_id(t) for t in
                       ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"))
    ids: list[int] = []
    images = []
    for part in parts:
        if isinstance(part, Processed):
            ids.append(start)
            images.append((len(ids), part))
            ids.extend([pad] * part.tokens)
            ids.append(end)
        else:
            ids.extend(part)
    return Prompt(ids, images)


def wire_images(prompt: Prompt) -> list[pb.Image]:
    return [
        pb.Image(pixel_values=image.pixel_values.numpy().astype("<f4").tobytes(),
                 shape=list(image.pixel_values.shape), dtype="float32", grid=list(image.grid),
                 token_offset=offset, token_count=image.tokens,
                 content_hash=bytes([k]) * 16)
        for k, (offset, image) in enumerate(prompt.images)
    ]


def hf_generate(model_dir: Path, prompt: Prompt, max_new: int) -> tuple[list[int], list[float]]:
    """transformers' Qwen2VLForConditionalGeneration.generate (Qwen2_5_VL... for that family),
    greedy, EOS ignored: tokens and each one's logprob under the raw logits."""
    kwargs: dict[str, torch.Tensor] = {}
    if prompt.images:
        kwargs["pixel_values"] = torch.cat([i.pixel_values for _, i in prompt.images])
        kwargs["image_grid_thw"] = torch.tensor([list(i.grid) for _, i in prompt.images])
        types = torch.zeros(1, len(prompt.ids), dtype=torch.int32)
        for offset, image in prompt.images:
            types[0, offset : offset + image.tokens] = 1
        kwargs["mm_token_type_ids"] = types
    return hf_vlm_greedy(model_dir, prompt.ids, max_new, **kwargs)

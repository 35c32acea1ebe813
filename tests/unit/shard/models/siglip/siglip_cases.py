"""Prompts of the tiny PaliGemma / Gemma 3 checkpoints processed by transformers' own
processors, as the router sends them, and transformers' generate on them: the oracle of the
shard's tests."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image as PILImage

from pytgi_proto import generate_pb2 as pb
from tests.hf_reference import hf_vlm_greedy
from tests.siglip_models import load_processor


def picture(size: tuple[int, int], seed: int) -> PILImage.Image:
    rng = np.random.default_rng(seed)
    return PILImage.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    # [images, 3, S, S] float32, or None (text only).
    pixel_values: torch.Tensor | None
    # transformers' token_type_ids (PaliGemma: 0 over the prompt; Gemma 3: 1 on image tokens).
    token_type_ids: list[int]
    # (offset, count) of each image's tokens.
    spans: list[tuple[int, int]]


def _spans(ids: list[int], image_id: int, per_image: int) -> list[tuple[int, int]]:
    """(offset, count) of each image: the image tokens in runs of `per_image` (PaliGemma's
    images are adjacent)."""
    at = [i for i, t in enumerate(ids) if t == image_id]
    return [(at[k], per_image) for k in range(0, len(at), per_image)]


def paligemma_prompt(model_dir: Path, text: str, images: list[PILImage.Image]) -> Prompt:
    """PaliGemmaProcessor's input_ids (image tokens, <bos>, text, "\\n") and pixels; text only:
    the same text after <bos>, the whole prompt its prefix (token_type_ids 0)."""
    processor = load_processor(model_dir)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if images:
            out = processor(images=[images], text=[text], return_tensors="pt")
        else:
            out = processor.tokenizer([processor.tokenizer.bos_token + text + "\n"],
                                      add_special_tokens=False, return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    return Prompt(ids, out.get("pixel_values"), [0] * len(ids),
                  _spans(ids, processor.image_token_id, processor.image_seq_length))


def gemma3_prompt(model_dir: Path, content: list[str | PILImage.Image]) -> Prompt:
    """One user message of text and images through Gemma 3's chat template and processor."""
    processor = load_processor(model_dir)
    parts = [{"type": "text", "text": c} if isinstance(c, str) else {"type": "image"}
             for c in content]
    images = [c for c in content if not isinstance(c, str)]
    text = processor.apply_chat_template([{"role": "user", "content": parts}],
                                         add_generation_prompt=True, tokenize=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = processor(images=[images] if images else None, text=[text], return_tensors="pt",
                        add_special_tokens=False)
    ids = out["input_ids"][0].tolist()
    types = out["token_type_ids"][0].tolist() if "token_type_ids" in out else [0] * len(ids)
    image_id = processor.tokenizer.convert_tokens_to_ids(processor.tokenizer.image_token)
    return Prompt(ids, out.get("pixel_values"), types,
                  _spans(ids, image_id, processor.image_seq_length))


def wire_images(prompt: Prompt) -> list[pb.Image]:
    if prompt.pixel_values is None:
        return []
    return [
        pb.Image(pixel_values=pixels.numpy().astype("<f4").tobytes(), shape=list(pixels.shape),
                 dtype="float32", token_offset=offset, token_count=count,
                 content_hash=bytes([k + 1]) * 16)
        for k, (pixels, (offset, count)) in enumerate(
            zip(prompt.pixel_values, prompt.spans, strict=True))
    ]


def hf_generate(model_dir: Path, prompt: Prompt, max_new: int) -> tuple[list[int], list[float]]:
    """transformers' generate (PaliGemma / Gemma3ForConditionalGeneration), greedy, EOS
    ignored, with the processor's token_type_ids: tokens and each one's logprob."""
    kwargs: dict[str, torch.Tensor] = {
        "token_type_ids": torch.tensor([prompt.token_type_ids])}
    if prompt.pixel_values is not None:
        kwargs["pixel_values"] = prompt.pixel_values
    return hf_vlm_greedy(model_dir, prompt.ids, max_new, **kwargs)

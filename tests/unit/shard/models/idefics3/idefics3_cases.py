"""Prompts of the tiny Idefics3 checkpoint made by transformers' own Idefics3Processor (its chat
template, tiles and image tokens), the wire images the router sends for them (one per tile,
over its run of `<image>` tokens), and transformers' generate on them: the oracle of the shard's
and the serving tests."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image as PILImage

from pytgi_proto import generate_pb2 as pb
from tests.hf_reference import hf_vlm_greedy


def picture(size: tuple[int, int], seed: int) -> PILImage.Image:
    rng = np.random.default_rng(seed)
    return PILImage.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    # [tiles, 3, S, S] float32 over all the prompt's images (in order), or None (text only).
    pixel_values: torch.Tensor | None
    # (offset, count) of each tile's run of image tokens.
    spans: list[tuple[int, int]]


def load_processor(path: Path) -> object:
    """Idefics3Processor (SmolVLM checkpoints too: SmolVLMProcessor's image prompt is the same
    code, and it needs num2words for videos)."""
    from transformers import Idefics3Processor

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Idefics3Processor.from_pretrained(path)


def idefics3_prompt(path: Path, content: list[str | PILImage.Image]) -> Prompt:
    """One user message of text and images through the checkpoint's chat template and
    Idefics3Processor."""
    processor = load_processor(path)
    parts = [{"type": "text", "text": c} if isinstance(c, str) else {"type": "image"}
             for c in content]
    images = [c for c in content if not isinstance(c, str)]
    text = processor.apply_chat_template(  # type: ignore[attr-defined]
        [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = processor(images=[images] if images else None, text=[text],  # type: ignore[operator]
                        return_tensors="pt", add_special_tokens=False)
    ids = out["input_ids"][0].tolist()
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")  # type: ignore[attr-defined]
    seq = processor.image_seq_len  # type: ignore[attr-defined]
    at = [i for i, t in enumerate(ids) if t == image_id]
    spans = [(at[k], seq) for k in range(0, len(at), seq)]
    for offset, count in spans:
        assert ids[offset:offset + count] == [image_id] * count
    pixels = out["pixel_values"][0] if images else None
    if pixels is not None:
        assert pixels.shape[0] == len(spans)
    return Prompt(ids, pixels, spans)


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


def hf_generate(path: Path, prompt: Prompt, max_new: int) -> tuple[list[int], list[float]]:
    """transformers' generate (Idefics3 / SmolVLMForConditionalGeneration), greedy, EOS ignored:
    tokens and each one's logprob."""
    kwargs = {} if prompt.pixel_values is None else {"pixel_values": prompt.pixel_values[None]}
    return hf_vlm_greedy(path, prompt.ids, max_new, **kwargs)

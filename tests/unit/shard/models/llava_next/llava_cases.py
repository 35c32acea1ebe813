"""A tiny LLaVA-NeXT, its images processed by transformers' own processor, prompts, and
transformers' generate on them: the oracle the shard's and the serving tests compare against."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image as PILImage

from pytgi_proto import generate_pb2 as pb
from tests.hf_reference import hf_vlm_greedy
from tests.vision_checkpoints import LLAVA_IMAGE_TOKEN


@dataclass(frozen=True)
class Processed:
    """One image as the router sends it: tiles [1 + n, C, S, S], its original (height, width)
    and its token count (as LlavaNextProcessor counts them)."""

    pixel_values: torch.Tensor
    size: tuple[int, int]
    tokens: int


def is_llava(model_dir: Path) -> bool:
    """LLaVA 1.5 (one tile per image) rather than LLaVA-NeXT."""
    import json

    return bool(json.loads((model_dir / "config.json").read_text())["model_type"] == "llava")


def process(model_dir: Path, image: PILImage.Image) -> Processed:
    """transformers' LlavaNextProcessor (LlavaProcessor for LLaVA 1.5) of the checkpoint (the
    router's equals it)."""
    import json

    from transformers import LlavaNextProcessor, LlavaProcessor, PreTrainedTokenizerFast
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil
    from transformers.models.llava_next.image_processing_pil_llava_next import (
        LlavaNextImageProcessorPil,
    )

    config = json.loads((model_dir / "config.json").read_text())
    tok = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    llava = is_llava(model_dir)
    image_processor = (LlavaImageProcessorPil if llava
                       else LlavaNextImageProcessorPil).from_pretrained(model_dir)
    processor = (LlavaProcessor if llava else LlavaNextProcessor)(
        image_processor=image_processor, tokenizer=tok,
        patch_size=config["vision_config"]["patch_size"], vision_feature_select_strategy="default",
        num_additional_image_tokens=1, image_token=LLAVA_IMAGE_TOKEN)
    out = processor(images=[image], text=LLAVA_IMAGE_TOKEN, return_tensors="pt")
    image_id = tok.convert_tokens_to_ids(LLAVA_IMAGE_TOKEN)
    tokens = int((out["input_ids"] == image_id).sum())
    if llava:  # [1, C, S, S]; the wire still says the original (height, width)
        return Processed(out["pixel_values"].float(), (image.height, image.width), tokens)
    size = tuple(int(v) for v in out["image_sizes"][0])
    return Processed(out["pixel_values"][0].float(), size, tokens)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    images: list[tuple[int, Processed]]  # (token offset, image)


def prompt_with(model_dir: Path, parts: list[list[int] | Processed]) -> Prompt:
    """Text ids and images in order; each image as its run of image tokens."""
    from tokenizers import Tokenizer

    image_id = Tokenizer.from_file(str(model_dir / "tokenizer.json")).token_to_id(
        LLAVA_IMAGE_TOKEN)
    ids: list[int] = []
    images = []
    for part in parts:
        if isinstance(part, Processed):
            images.append((len(ids), part))
            ids.extend([image_id] * part.tokens)
        else:
            ids.extend(part)
    return Prompt(ids, images)


def wire_images(prompt: Prompt) -> list[pb.Image]:
    return [
        pb.Image(pixel_values=image.pixel_values.numpy().astype("<f4").tobytes(),
                 shape=list(image.pixel_values.shape), dtype="float32", grid=list(image.size),
                 token_offset=offset, token_count=image.tokens, content_hash=bytes([k]) * 16)
        for k, (offset, image) in enumerate(prompt.images)
    ]


def hf_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(
        model_dir, torch_dtype=torch.float32, attn_implementation="eager").eval()


def stacked(images: list[Processed], llava: bool = False) -> dict[str, torch.Tensor]:
    """pixel_values [images, most tiles, C, S, S] (zero-padded, as the processor batches them)
    and image_sizes; LLaVA 1.5's ([images, C, S, S]) alone."""
    if llava:
        return {"pixel_values": torch.cat([i.pixel_values for i in images])}
    most = max(i.pixel_values.shape[0] for i in images)
    pixels = torch.zeros(len(images), most, *images[0].pixel_values.shape[1:])
    for k, image in enumerate(images):
        pixels[k, : image.pixel_values.shape[0]] = image.pixel_values
    return {"pixel_values": pixels, "image_sizes": torch.tensor([list(i.size) for i in images])}


def hf_generate(model_dir: Path, prompt: Prompt, max_new: int) -> tuple[list[int], list[float]]:
    """transformers' LlavaNextForConditionalGeneration.generate, greedy, EOS ignored: tokens
    and each one's logprob under the raw logits."""
    images = [i for _, i in prompt.images]
    kwargs = stacked(images, is_llava(model_dir)) if images else {}
    return hf_vlm_greedy(model_dir, prompt.ids, max_new, **kwargs)

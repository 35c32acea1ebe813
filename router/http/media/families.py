"""The vision-language families whose images the router prepares, in one table keyed by
config.json's `model_type`: each family's image processor (a port of transformers' onto numpy +
Pillow) and how its prompts carry an image (`PromptImages`). Adding a family = its processor
module and one row here; vision_model.py, prepare.py and the wire stay as they are."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from pytgi_router.http.media.idefics3 import Idefics3ImageProcessor
from pytgi_router.http.media.llava_next import LlavaNextImageProcessor
from pytgi_router.http.media.processed import ImageProcessor
from pytgi_router.http.media.qwen2_vl import Qwen2VLImageProcessor
from pytgi_router.http.media.siglip import gemma3_processor, paligemma_processor

# config.json model types of the vision-language models TGI, vLLM or SGLang serve (those not in
# VISION_FAMILIES are refused with "not prepared by this server yet", not served as text).
VLM_MODEL_TYPES = frozenset({
    "qwen2_vl", "qwen2_5_vl", "llava", "llava_next", "gemma3", "idefics", "idefics2",
    "idefics3", "paligemma", "mllama", "llama4", "smolvlm",
})


@dataclass(frozen=True, slots=True)
class PromptImages:
    """How a family's prompt carries one image of n tokens.

    image_token: the token repeated once per image token (the shard's rows are found by its id).
    placeholder: what the model's chat template writes for each image part (transformers'
    processor expands it; so does VisionModel.chat_text).
    chat: what replaces each placeholder in a rendered chat prompt; "{}" = image_token * n.
    markdown: what replaces each `![](…)` in `/generate` inputs (TGI's rendering for the
    family); "{}" = image_token * n.
    attention: "causal", or where the model attends bidirectionally: "prefix" (PaliGemma: the
    whole prompt is its prefix; the prompt also gets <bos> after its last image and "\n" at
    its end, PaliGemmaProcessor's layout, and the tokenizer adds no BOS of its own) or
    "images" (Gemma 3: each image's tokens). The router never splits such a span across
    prefill chunks (noncausal_spans, router/core/step_plan.py).
    """

    image_token: str
    placeholder: str
    chat: str = "{}"
    markdown: str = "{}"
    attention: str = "causal"

    def noncausal_spans(self, images: Sequence[tuple[int, int]], prompt: int
                        ) -> tuple[tuple[int, int], ...]:
        """The prompt's bidirectional spans [lo, hi) from its images' (offset, count)."""
        if self.attention == "prefix":
            return ((0, prompt),) if prompt else ()
        if self.attention == "images":
            return tuple((offset, offset + count) for offset, count in images)
        return ()

    def chat_text(self, count: int, body: str = "") -> str:
        """`body`: the image's own text (ProcessedImage.text) where the family makes one."""
        return self.chat.format(body or self.image_token * count)

    def markdown_text(self, count: int, body: str = "") -> str:
        return self.markdown.format(body or self.image_token * count)


# Builds a family's processor from (config.json, preprocessor_config.json); raises ValueError
# naming what the checkpoint lacks.
ProcessorFactory = Callable[[Mapping[str, Any], Mapping[str, Any]], ImageProcessor]


@dataclass(frozen=True, slots=True)
class VisionFamily:
    name: str
    prompt: PromptImages
    processor: ProcessorFactory
    # config.json keys that may hold the image token's id, used when the tokenizer has no token
    # named prompt.image_token (checkpoints that renamed it).
    token_id_keys: tuple[str, ...] = ("image_token_id", "image_token_index")


QWEN2_VL = VisionFamily(
    "qwen2_vl",
    PromptImages("<|image_pad|>", "<|image_pad|>",
                 markdown="<|vision_start|>{}<|vision_end|>"),
    lambda config, pre: Qwen2VLImageProcessor.from_config(dict(pre)),
)
# TGI renders a LLaVA-NeXT markdown image as the image tokens alone; its templates write one
# `<image>` per image part.
LLAVA_NEXT = VisionFamily(
    "llava_next",
    PromptImages("<image>", "<image>"),
    LlavaNextImageProcessor.from_checkpoint,
)
# LLaVA 1.5: the same prompt (its templates write one `<image>` per image part); one tile.
LLAVA = VisionFamily(
    "llava",
    PromptImages("<image>", "<image>"),
    LlavaNextImageProcessor.llava,
)

# PaliGemma: "<image>" per image token, placed as PaliGemmaProcessor places it (PromptImages
# .attention "prefix"); its checkpoints ship no chat template, so chat needs one that writes
# "<image>" per image part.
PALIGEMMA = VisionFamily(
    "paligemma",
    PromptImages("<image>", "<image>", attention="prefix"),
    paligemma_processor,
)
# Gemma 3: its template writes <start_of_image> per image part, which Gemma3Processor expands
# to "\n\n<start_of_image>" + soft tokens + "<end_of_image>\n\n"; a markdown image the same.
GEMMA3_IMAGE = "\n\n<start_of_image>{}<end_of_image>\n\n"
GEMMA3 = VisionFamily(
    "gemma3",
    PromptImages("<image_soft_token>", "<start_of_image>", chat=GEMMA3_IMAGE,
                 markdown=GEMMA3_IMAGE, attention="images"),
    gemma3_processor,
)

# Idefics3: its template writes one `<image>` per image part, which Idefics3Processor expands
# into the image's tile grid (ProcessedImage.text: `<fake_token_around_image>`, `<row_r_col_c>`,
# `<global-img>`, image_seq_len `<image>` per tile); a markdown image the same (TGI's). SmolVLM
# (`smolvlm`) is the same processor and prompt (transformers' SmolVLM image processor and image
# prompt are Idefics3's code).
IDEFICS3 = VisionFamily(
    "idefics3",
    PromptImages("<image>", "<image>"),
    Idefics3ImageProcessor.from_checkpoint,
)

VISION_FAMILIES: Mapping[str, VisionFamily] = MappingProxyType({
    "qwen2_vl": QWEN2_VL,
    "qwen2_5_vl": QWEN2_VL,
    "llava_next": LLAVA_NEXT,
    "llava": LLAVA,
    "paligemma": PALIGEMMA,
    "gemma3": GEMMA3,
    "idefics3": IDEFICS3,
    "smolvlm": IDEFICS3,
})

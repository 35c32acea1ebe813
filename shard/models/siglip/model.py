"""PaliGemma (`paligemma`) and Gemma 3 multimodal (`gemma3`): the registry's Gemma decoders
(shard/models/llama/gemma.py: `gemma` for PaliGemma 1, `gemma2` for PaliGemma 2,
`gemma3_text` for Gemma 3, read from config.json's text_config) fed, in place of each image's
tokens, SigLIP's last hidden state (vision.py) through the family's projector (projectors.py).

What differs from a causal decoder is the attention mask, which the model gives the attention
backends as bidirectional spans (AttentionMetadata.spans, from its ImageLayout's
noncausal_spans):
- PaliGemma is a prefix LM: the whole prompt (images, <bos>, the text and its "\\n") attends
  bidirectionally (transformers' token_type_ids 0 over the prompt); generated tokens causally.
  Text-only prompts too (the prompt is the prefix; transformers makes PaliGemma 1's text-only
  prompts bidirectional and PaliGemma 2's causal, by a mask shortcut, so pytgi follows the
  processor's token_type_ids rather than either).
- Gemma 3 attends bidirectionally within each image's soft tokens, causally elsewhere, its
  sliding layers' window included (transformers' or_mask of the block ids).
PaliGemma's positions start at 1 (transformers' PaliGemmaModel adds 1 to position_ids), for
text, image and decode rows alike: `position_offset`, the one thing this family's forward
(LlamaVLM's, shard/models/vision_language.py) does apart.

Image rows replace the token embeddings after Gemma's sqrt(hidden_size) normalizer (which
transformers 5 applies inside the embedding), so the projected features go in unscaled.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from pytgi_shard.attention.backend import AttentionBackend
from pytgi_shard.device.distributed import Dist
from pytgi_shard.models.config_layout import legacy_layout
from pytgi_shard.models.fused_qkv_decoder import with_weights
from pytgi_shard.models.llama.config import LlamaConfig
from pytgi_shard.models.llama.gemma import gemma2_config, gemma3_text_config, gemma_config
from pytgi_shard.models.model_config import ModelConfig
from pytgi_shard.models.siglip.projectors import Gemma3Projector, PaliGemmaProjector
from pytgi_shard.models.siglip.vision import (
    SiglipConfig,
    SiglipVisionTower,
    image_patches,
    siglip_prefix,
)
from pytgi_shard.models.vision_language import FixedSizeVLM, ImageEmbeddings
from pytgi_shard.weights.reader import Weights

TEXT_CONFIGS: Mapping[str, Callable[[Mapping[str, Any]], LlamaConfig]] = {
    "gemma": gemma_config, "gemma2": gemma2_config, "gemma3_text": gemma3_text_config,
}
# transformers' Gemma3Config default.
GEMMA3_MM_TOKENS = 256


def text_config(raw: Mapping[str, Any], default_type: str) -> LlamaConfig:
    """The Gemma decoder of config.json's text_config (transformers 4's or 5's layout; a
    PaliGemma 1 text_config may omit its model_type)."""
    text = legacy_layout(dict(raw.get("text_config") or {}))
    model_type = str(text.get("model_type", default_type))
    if model_type not in TEXT_CONFIGS:
        raise ValueError(f"{raw.get('model_type')} with a {model_type!r} text model: only "
                         f"{', '.join(TEXT_CONFIGS)} are served")
    return TEXT_CONFIGS[model_type]({**text, "model_type": model_type})


def text_names(weights: Weights) -> dict[str, str]:
    """The decoder's names (`model.*`, `lm_head.weight`) for the checkpoint's text half, kept
    under `language_model.` (transformers 4, the Hub's checkpoints) or `model.language_model.`
    (transformers 5's own layout)."""
    out = {}
    for name in weights.names():
        if name.startswith("language_model."):
            out[name.removeprefix("language_model.")] = name
        elif name.startswith("model.language_model."):
            out["model." + name.removeprefix("model.language_model.")] = name
    return out


def projector_prefix(weights: Weights) -> str:
    for prefix in ("multi_modal_projector", "model.multi_modal_projector"):
        if any(n.startswith(prefix + ".") for n in weights.names()):
            return prefix
    raise ValueError(f"no multi_modal_projector in the checkpoint at {weights.model_path}")


@dataclass(frozen=True, slots=True)
class SiglipImages:
    """The wire images of a SigLIP-tower model: no grid, pixels [C, S, S] at the tower's fixed
    size, a fixed token count; and the model's bidirectional spans (`prefix`: the whole prompt,
    PaliGemma; else each image, Gemma 3)."""

    channels: int
    image_size: int
    tokens: int
    prefix: bool
    mrope_merge: int = 0

    def refusal(self, grid: tuple[int, ...], shape: tuple[int, ...] | None, tokens: int
                ) -> str | None:
        if grid:
            return f"grid {list(grid)}: this model's images carry none"
        if tokens != self.tokens:
            return f"{tokens} tokens: this model's images take {self.tokens}"
        want = (self.channels, self.image_size, self.image_size)
        if shape is not None and shape != want:
            return f"pixel values of shape {list(shape)} are not float32 {list(want)}"
        return None

    def noncausal_spans(self, images: tuple[tuple[int, int], ...], prompt: int
                        ) -> tuple[tuple[int, int], ...]:
        if self.prefix:
            return ((0, prompt),)
        return tuple((offset, offset + count) for offset, count in images)


class SiglipVLM(FixedSizeVLM):
    """A Gemma decoder with a SigLIP tower and a projector (PaliGemma or Gemma 3)."""

    def __init__(self, config: LlamaConfig, raw: Mapping[str, Any], weights: Weights,
                 backend: AttentionBackend) -> None:
        super().__init__(config, weights.with_names(text_names(weights)), backend)
        vision = SiglipConfig.from_dict(raw.get("vision_config") or {})
        self.visual = SiglipVisionTower(weights, siglip_prefix(weights, "vision_tower"), vision)
        projector = projector_prefix(weights)
        self.model_type = str(raw["model_type"])
        paligemma = self.model_type == "paligemma"
        if paligemma:
            self.projector: torch.nn.Module = PaliGemmaProjector(weights, projector)
            tokens = vision.num_patches
        else:
            tokens = int(raw.get("mm_tokens_per_image", GEMMA3_MM_TOKENS))
            self.projector = Gemma3Projector(weights, projector, vision.patches_per_side,
                                             tokens, vision.layer_norm_eps)
        self.image_layout = SiglipImages(vision.num_channels, vision.image_size, tokens,
                                         prefix=paligemma)
        self.pixel_shape = (vision.num_channels, vision.image_size, vision.image_size)
        # PaliGemma numbers positions from 1.
        self.position_offset = 1 if paligemma else 0
        self.images = ImageEmbeddings()

    @classmethod
    def load(cls, config: ModelConfig, dtype: torch.dtype, dist: Dist,
             backend: AttentionBackend) -> SiglipVLM:
        default = "gemma" if config.model_type == "paligemma" else "gemma3_text"
        decoder = text_config(config.raw, default)
        return with_weights(config, dtype, dist,
                            lambda weights: cls(decoder, config.raw, weights, backend))

    def encode(self, pixel_values: torch.Tensor, grid: tuple[int, ...]) -> torch.Tensor:
        """One image's rows [tokens, hidden]: its patches through the tower and projector."""
        patches = image_patches(pixel_values.to(self.device), self.visual.config.patch_size)
        return self.projector(self.visual(patches)).to(self.dtype)

"""What every vision-language model on the shards shares, whatever its tower: the tower's output
kept per (request, image) between the chunks of a prefill (`ImageEmbeddings`), the step that
puts an image's embedding rows in place of its tokens' (`ImageEncoder.place_images`), and the
forward of a Llama-style decoder fed those rows (`LlamaVLM`; `FixedSizeVLM` for a tower that
takes one image size). A family says only how one image is encoded (`encode`: its tower +
projector, on the pixel values and grid the router's processor made), how its images' wire
fields must look (`image_layout`, shard/models/media_inputs.py), and what it does apart
(`position_offset`, `_image_rotations`, `warmup_images`). Registered families:
shard/models/vision_families.py."""

from __future__ import annotations

from abc import abstractmethod
from collections import OrderedDict

import torch

from pytgi_shard.attention.kv_cache import KVCache
from pytgi_shard.attention.metadata import AttentionMetadata
from pytgi_shard.models.llama.model import Llama
from pytgi_shard.models.media_inputs import ImageRows, StepMedia

# Images whose embeddings are kept between the chunks of a prefill at most (oldest dropped
# first: an evicted image is encoded again if a later chunk needs it, so this bounds memory
# only; a request cancelled between two chunks of one image leaves its entry until then).
KEPT_IMAGES = 32


class ImageEmbeddings:
    """The tower's output per (request, image offset), kept while chunks still need it."""

    def __init__(self, limit: int = KEPT_IMAGES) -> None:
        self.limit = limit
        self._kept: OrderedDict[tuple[int, int], torch.Tensor] = OrderedDict()

    def get(self, key: tuple[int, int]) -> torch.Tensor | None:
        return self._kept.get(key)

    def keep(self, key: tuple[int, int], embeddings: torch.Tensor) -> None:
        self._kept[key] = embeddings
        while len(self._kept) > self.limit:
            self._kept.popitem(last=False)

    def drop(self, key: tuple[int, int]) -> None:
        self._kept.pop(key, None)

    def __len__(self) -> int:
        return len(self._kept)


class ImageEncoder:
    """Mixed into a vision-language model (beside its decoder class): `images` must be set
    (an ImageEmbeddings) in its __init__."""

    images: ImageEmbeddings

    @abstractmethod
    def encode(self, pixel_values: torch.Tensor, grid: tuple[int, ...]) -> torch.Tensor:
        """One image's token embeddings [tokens, hidden] in the decoder's dtype, in prompt
        order: the family's tower, projector and packing."""

    def image_rows(self, image: ImageRows) -> torch.Tensor:
        """The rows [lo, hi) of an image's embeddings, encoding it first unless kept; dropped
        once its last token is computed."""
        key = (image.request_id, image.offset)
        embeddings = self.images.get(key)
        if embeddings is None:
            if image.pixel_values is None:
                raise ValueError(f"request {image.request_id}: the image at token "
                                 f"{image.offset} has no pixel values and none are kept")
            embeddings = self.encode(image.pixel_values, image.grid)
            if embeddings.shape[0] != image.count:
                raise ValueError(
                    f"request {image.request_id}: the image at token {image.offset} has "
                    f"{image.count} tokens, its grid {list(image.grid)} gives "
                    f"{embeddings.shape[0]}")
        if image.hi < image.count:
            self.images.keep(key, embeddings)
        else:
            self.images.drop(key)
        return embeddings[image.lo : image.hi]

    def place_images(self, hidden: torch.Tensor, media: StepMedia) -> torch.Tensor:
        """`hidden` (the chunk's token embeddings) with each image's rows in place."""
        for image in media.images:
            hidden[image.row : image.row + image.hi - image.lo] = self.image_rows(image)
        return hidden


class LlamaVLM(Llama, ImageEncoder):
    """A vision-language model on the registry's Llama-style decoder (every family's: Qwen2-VL,
    LLaVA, Idefics3, PaliGemma, Gemma 3), its forward taking a prefill's StepMedia."""

    # Added to every position the engine gives, text, image and decode rows alike (PaliGemma
    # numbers positions from 1, transformers' PaliGemmaModel adding 1 to position_ids).
    position_offset: int = 0

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        lm_head_indices: torch.Tensor | None = None,
        media: StepMedia | None = None,
    ) -> torch.Tensor:
        """Without media (text-only requests, every decode step) the decoder's own forward, so
        decode CUDA graphs capture and replay it unchanged; with it, each image's rows in place
        of its tokens' embeddings (placed after the decoder's embedding scale: Gemma's
        normalizer applies to text rows only), the step's bidirectional spans in the metadata
        (None for a causal family), at the family's rotations."""
        if self.position_offset:
            positions = positions + self.position_offset
        if media is None:
            return super().forward(input_ids, positions, kv_cache, meta, lm_head_indices)
        # Every layer's attention reads the spans from the metadata.
        meta.spans = media.spans
        hidden = self.place_images(self._embed(input_ids), media)
        rotations = self._image_rotations(positions, media, hidden.dtype)
        return self._layers_to_logits(hidden, rotations, kv_cache, meta, lm_head_indices)

    def _image_rotations(self, positions: torch.Tensor, media: StepMedia, dtype: torch.dtype
                         ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's (cos, sin) for a forward with images: the plain 1-D positions' (an
        M-RoPE family's come from the StepMedia's 3-D positions instead)."""
        return self._rotations(positions, dtype)


class FixedSizeVLM(LlamaVLM):
    """A LlamaVLM whose tower takes images of one size (SigLIP's images, Idefics3's tiles):
    pixel values `pixel_shape` ([C, S, S], set in its __init__), no grid."""

    pixel_shape: tuple[int, int, int]

    def warmup_images(self) -> None:
        """Every image is the same size: one, so Warmup's peak includes the tower's."""
        self.encode(torch.zeros(self.pixel_shape, device=self.device), ())

"""The vision-language families the shards serve, by config.json `model_type`: each a decoder of
the registry (shard/models/llama/) with an ImageEncoder (shard/models/vision_language.py) whose
`encode` is its tower + projector and whose `image_layout` says how its wire images look and
whether positions are M-RoPE (Qwen2-VL only) or plain 1-D (the others). MODELS
(shard/models/__init__.py) takes every row."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from pytgi_shard.models.idefics3.model import Idefics3
from pytgi_shard.models.llama.model import ModelLoader
from pytgi_shard.models.llava_next.model import LlavaNext
from pytgi_shard.models.qwen2_vl.model import Qwen2VL
from pytgi_shard.models.siglip.model import SiglipVLM

VISION_FAMILIES: Mapping[str, ModelLoader] = MappingProxyType({
    "qwen2_vl": Qwen2VL.load,
    "qwen2_5_vl": Qwen2VL.load,
    "paligemma": SiglipVLM.load,
    "gemma3": SiglipVLM.load,
    "llava_next": LlavaNext.load,
    "llava": LlavaNext.load,
    "idefics3": Idefics3.load,
    "smolvlm": Idefics3.load,
})

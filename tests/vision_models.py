"""Tiny random-weight vision-language checkpoints the shards serve, made from transformers' own
classes (no Hub): the router's files of tests/vision_checkpoints.py (tokenizer with the vision
tokens, chat template, image processor) plus a config whose token ids are that tokenizer's and
safetensors weights."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from tests.tiny_models import BOS, EOS, PAD
from tests.vision_checkpoints import (
    LLAVA_IMAGE_TOKEN,
    LLAVA_PATCH,
    LLAVA_PINPOINTS,
    LLAVA_TILE,
    MAX_PIXELS,
    write_llava_next_tokenizer,
    write_qwen2_vl_router_files,
)

# The vision-language families these tiny checkpoints cover: served (against transformers, with
# images, on 1 and 2 ranks) by tests/integration/test_qwen2_vl_serving.py and
# test_llava_next_serving.py (PaliGemma and Gemma 3: test_siglip_serving.py, their checkpoints
# from tests/siglip_models.py; Idefics3: test_idefics3_serving.py, tests/idefics3_models.py)
# rather than by the text families' serving test.
VISION_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "llava_next", "llava", "paligemma", "gemma3",
                   "idefics3", "smolvlm")

# The text half: 4 query heads over 2 KV heads (two ranks split both), head_dim 16, whose 8
# rotary frequencies M-RoPE splits into temporal, height and width sections. Weights 15x
# transformers' default spread: attention sharp enough that a wrong position or image changes
# the greedy tokens (at 0.02 the logits are near uniform and would hide either).
QWEN2_VL_TEXT = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "intermediate_size": 96, "rms_norm_eps": 1e-6,
                 "initializer_range": 0.3,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                     "mrope_section": [2, 3, 3]}}
QWEN2_VL_VISION = {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2,
                   "mlp_ratio": 2, "initializer_range": 0.3}
# Qwen2.5-VL's tower: windows of 56 pixels (2 x 2 merged tokens), block 1 of 3 attending to the
# whole image.
QWEN2_5_VL_VISION = {"depth": 3, "hidden_size": 32, "out_hidden_size": 64, "num_heads": 2,
                     "intermediate_size": 48, "window_size": 56, "fullatt_block_indexes": [1],
                     "initializer_range": 0.3}


def write_qwen2_vl_model(path: Path, max_pixels: int = MAX_PIXELS, seed: int = 0,
                         family: str = "qwen2_vl") -> Path:
    """A whole tiny Qwen2-VL (or, `family` qwen2_5_vl, Qwen2.5-VL) checkpoint at `path`
    (float32), as transformers saves it."""
    import torch
    from transformers import (
        GenerationConfig,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )

    write_qwen2_vl_router_files(path, max_pixels=max_pixels)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids: dict[str, Any] = {
        "bos_token_id": tok.token_to_id(BOS), "eos_token_id": tok.token_to_id(EOS),
        "pad_token_id": tok.token_to_id(PAD),
    }
    vision_ids = {
        "vision_start_token_id": tok.token_to_id("<|vision_start|>"),
        "image_token_id": tok.token_to_id("<|image_pad|>"),
        "vision_end_token_id": tok.token_to_id("<|vision_end|>"),
        # No video token in this tokenizer: an id no prompt holds.
        "video_token_id": tok.get_vocab_size() + 1,
    }
    text = {**QWEN2_VL_TEXT, "vocab_size": tok.get_vocab_size() + 2, **ids}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        windowed = family == "qwen2_5_vl"
        config_class = Qwen2_5_VLConfig if windowed else Qwen2VLConfig
        config = config_class(text_config=text,
                              vision_config=QWEN2_5_VL_VISION if windowed else QWEN2_VL_VISION,
                              torch_dtype="float32", **vision_ids, **ids)
        torch.manual_seed(seed)
        model_class = (Qwen2_5_VLForConditionalGeneration if windowed
                       else Qwen2VLForConditionalGeneration)
        model = model_class(config).eval()
        model.save_pretrained(path, safe_serialization=True)
    GenerationConfig(**ids).save_pretrained(path)
    return path




# LLaVA-NeXT's text half: a Llama as Qwen2-VL's (two ranks split its heads), sharp weights; its
# CLIP tower: 3 layers (vision_feature_layer -2 reads the second), 2 heads.
LLAVA_TEXT = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
              "rms_norm_eps": 1e-6, "initializer_range": 0.3, "max_position_embeddings": 512}
LLAVA_VISION = {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 48,
                "num_hidden_layers": 3, "num_attention_heads": 2, "image_size": LLAVA_TILE,
                "patch_size": LLAVA_PATCH, "projection_dim": 32, "initializer_factor": 3.0}


def write_llava_next_model(path: Path, seed: int = 0, family: str = "llava_next") -> Path:
    """A whole tiny LLaVA-NeXT (or, `family` llava, LLaVA 1.5) checkpoint at `path` (float32),
    as transformers saves it, with its tokenizer (`<image>` added), LLaVA-NeXT-like chat
    template and image processor."""
    import torch
    from transformers import (
        GenerationConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
    )

    tok = write_llava_next_tokenizer(path, family)
    ids: dict[str, Any] = {
        "bos_token_id": tok.token_to_id(BOS), "eos_token_id": tok.token_to_id(EOS),
        "pad_token_id": tok.token_to_id(PAD),
    }
    text = {**LLAVA_TEXT, "vocab_size": tok.get_vocab_size(), **ids}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        image_token = tok.token_to_id(LLAVA_IMAGE_TOKEN)
        config = (LlavaConfig(text_config=text, vision_config=LLAVA_VISION,
                              image_token_index=image_token, torch_dtype="float32", **ids)
                  if family == "llava" else
                  LlavaNextConfig(text_config=text, vision_config=LLAVA_VISION,
                                  image_grid_pinpoints=LLAVA_PINPOINTS,
                                  image_token_index=image_token, torch_dtype="float32", **ids))
        torch.manual_seed(seed)
        model_class = (LlavaForConditionalGeneration if family == "llava"
                       else LlavaNextForConditionalGeneration)
        model = model_class(config).eval()
        model.save_pretrained(path, safe_serialization=True)
    GenerationConfig(**ids).save_pretrained(path)
    return path

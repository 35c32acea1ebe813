"""Tiny random-weight PaliGemma (`paligemma`) and Gemma 3 (`gemma3`) checkpoints, made from
transformers' own classes (no Hub): a byte-level tokenizer with the family's image tokens,
transformers' processor saved beside it (preprocessor_config.json, processor_config.json), the
config with that tokenizer's ids, and safetensors weights as transformers saves them.

The SigLIP tower sees 32 x 32 images in 8 x 8 patches (16 patches); PaliGemma's prompt takes
the 16 projected patches, Gemma 3's projector pools them 2 x 2 into 4 tokens. Weights spread
0.3 in the tower, 0.1 in the text half (5-15x transformers' default): attention sharp enough
that a wrong mask, position or image changes the greedy tokens."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from tests.tiny_models import _CORPUS, BOS, EOS, PAD, train_tokenizer

SIGLIP_FAMILIES = ("paligemma", "gemma3")
SIGLIP_VISION = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                 "num_attention_heads": 2, "image_size": 32, "patch_size": 8,
                 "initializer_range": 0.3}
# The Gemma text halves: 4 query heads over 2 KV heads (two ranks split both), head_dim 16;
# spread 0.1 (at 0.3 the tied embeddings make every prompt repeat its last token).
GEMMA_TEXT = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
              "initializer_range": 0.1, "query_pre_attn_scalar": 16}
GEMMA3_MM_TOKENS = 4
PALIGEMMA_IMAGE = "<image>"
GEMMA3_TOKENS = ("<start_of_image>", "<image_soft_token>", "<end_of_image>")
# PaliGemma checkpoints ship no chat template; this one writes the user's parts in order, an
# image as <image> (the router places <bos> and "\n" as PaliGemmaProcessor does).
PALIGEMMA_TEMPLATE = (
    "{% for message in messages %}{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% endfor %}"
)
# A Gemma-3-like template: each image part rendered as <start_of_image> (the processor expands it).
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<start_of_image>"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def _tokenizer(extra: tuple[str, ...], named: dict[str, str] | None = None) -> Any:
    """The tiny models' BPE tokenizer without its BOS post-processor (PaliGemma's and Gemma 3's
    processors put <bos> in the text themselves) and with `extra` special tokens."""
    from transformers import PreTrainedTokenizerFast

    tok: Tokenizer = train_tokenizer(_CORPUS)
    tok.post_processor = None
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD, model_max_length=512,
                                   extra_special_tokens=named or {})


def _ids(tok: Any) -> dict[str, int]:
    return {"bos_token_id": tok.convert_tokens_to_ids(BOS),
            "eos_token_id": tok.convert_tokens_to_ids(EOS),
            "pad_token_id": tok.convert_tokens_to_ids(PAD)}


def write_paligemma_model(path: Path, seed: int = 0, text_model_type: str = "gemma2") -> Path:
    """A tiny PaliGemma (text half `gemma`: PaliGemma 1, `gemma2`: PaliGemma 2) at `path`."""
    import torch
    from transformers import (
        GenerationConfig,
        PaliGemmaConfig,
        PaliGemmaForConditionalGeneration,
        PaliGemmaProcessor,
    )
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    path.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer((PALIGEMMA_IMAGE,), {"image_token": PALIGEMMA_IMAGE})
    tokens = (SIGLIP_VISION["image_size"] // SIGLIP_VISION["patch_size"]) ** 2
    images = SiglipImageProcessorPil(size={"height": 32, "width": 32})
    images.image_seq_length = tokens
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        processor = PaliGemmaProcessor(image_processor=images, tokenizer=tok)
        processor.save_pretrained(path)
        images.save_pretrained(path)
        ids = _ids(tok)
        text = {**GEMMA_TEXT, "model_type": text_model_type, "vocab_size": len(tok), **ids}
        if text_model_type == "gemma2":
            text.update(attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                        sliding_window=8)
        config = PaliGemmaConfig(
            vision_config={**SIGLIP_VISION, "projection_dim": GEMMA_TEXT["hidden_size"]},
            text_config=text, image_token_index=tok.convert_tokens_to_ids(PALIGEMMA_IMAGE),
            projection_dim=GEMMA_TEXT["hidden_size"], torch_dtype="float32", **ids)
        torch.manual_seed(seed)
        model = PaliGemmaForConditionalGeneration(config).eval()
        model.save_pretrained(path, safe_serialization=True)
    GenerationConfig(**ids).save_pretrained(path)
    _set_template(path, PALIGEMMA_TEMPLATE)
    return path


def _set_template(path: Path, template: str) -> None:
    config_path = path / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config.setdefault("chat_template", template)
    config_path.write_text(json.dumps(tokenizer_config))


def write_gemma3_model(path: Path, seed: int = 0) -> Path:
    """A tiny Gemma 3 (multimodal) at `path`: a sliding layer (window 8) and a global one."""
    import torch
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3Processor,
        GenerationConfig,
    )
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    path.mkdir(parents=True, exist_ok=True)
    boi, soft, eoi = GEMMA3_TOKENS
    tok = _tokenizer(GEMMA3_TOKENS, {"boi_token": boi, "image_token": soft, "eoi_token": eoi})
    tok.chat_template = GEMMA3_TEMPLATE
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        images = Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
        processor = Gemma3Processor(image_processor=images, tokenizer=tok,
                                    image_seq_length=GEMMA3_MM_TOKENS,
                                    chat_template=GEMMA3_TEMPLATE)
        processor.save_pretrained(path)
        images.save_pretrained(path)
        ids = _ids(tok)
        text = {**GEMMA_TEXT, "vocab_size": len(tok), "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention"], **ids}
        config = Gemma3Config(
            vision_config=SIGLIP_VISION, text_config=text, mm_tokens_per_image=GEMMA3_MM_TOKENS,
            boi_token_index=tok.convert_tokens_to_ids(boi),
            eoi_token_index=tok.convert_tokens_to_ids(eoi),
            image_token_index=tok.convert_tokens_to_ids(soft), torch_dtype="float32", **ids)
        torch.manual_seed(seed)
        model = Gemma3ForConditionalGeneration(config).eval()
        with torch.no_grad():
            # transformers starts the projection at zeros (no image would reach the text).
            projector = model.model.multi_modal_projector
            projector.mm_input_projection_weight.normal_(0, 0.3)
            projector.mm_soft_emb_norm.weight.normal_(0, 0.3)
        model.save_pretrained(path, safe_serialization=True)
    GenerationConfig(**ids).save_pretrained(path)
    _set_template(path, GEMMA3_TEMPLATE)
    return path


def load_processor(path: Path) -> Any:
    """transformers' processor of a checkpoint written here (the tests' reference)."""
    from transformers import AutoProcessor

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoProcessor.from_pretrained(path)

"""A tiny random-weight Idefics3 (`idefics3`) checkpoint, made from transformers' own classes (no
Hub): a byte-level tokenizer with Idefics3's image tokens (`<fake_token_around_image>`,
`<image>`, `<global-img>`, `<row_r_col_c>`), transformers' Idefics3Processor saved beside it, an
Idefics3-like chat template, the config with that tokenizer's ids, safetensors weights as
transformers saves them.

The tower sees 32 x 32 tiles in 8 x 8 patches (16 patches), pixel-shuffled by 2 into 4 tokens a
tile; images are resized to a longest edge of 96 (up to 3 x 3 tiles + the global image). The text
half is a Llama (4 query heads over 2 KV heads: two ranks split both). Weights spread 0.3:
attention sharp enough that a wrong tile, position or order changes the greedy tokens."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from tests.tiny_models import _CORPUS, BOS, EOS, PAD, train_tokenizer

IDEFICS3_TILE, IDEFICS3_PATCH, IDEFICS3_LONGEST = 32, 8, 96
IDEFICS3_SEQ_LEN = (IDEFICS3_TILE // IDEFICS3_PATCH // 2) ** 2
IDEFICS3_TOKENS = ("<fake_token_around_image>", "<image>", "<global-img>",
                   "<end_of_utterance>") + tuple(
    f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))
IDEFICS3_TEXT = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
                 "rms_norm_eps": 1e-6, "initializer_range": 0.3,
                 "max_position_embeddings": 1024}
IDEFICS3_VISION = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                   "num_attention_heads": 2, "image_size": IDEFICS3_TILE,
                   "patch_size": IDEFICS3_PATCH, "initializer_range": 0.3}
# Idefics3's template (SmolVLM's / Idefics3-8B's shape): "User:<image>text<end_of_utterance>\n".
IDEFICS3_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}: {{ message['content'] }}{% else %}"
    "{% if message['content'][0]['type'] == 'image' %}:{% else %}: {% endif %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


def idefics3_image_processor(longest: int = IDEFICS3_LONGEST, tile: int = IDEFICS3_TILE,
                             smolvlm: bool = False, **kwargs: Any) -> Any:
    """transformers' Idefics3 (or SmolVLM) image processor (PIL backend) at these sizes."""
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )
    from transformers.models.smolvlm.image_processing_pil_smolvlm import (
        SmolVLMImageProcessorPil,
    )

    cls = SmolVLMImageProcessorPil if smolvlm else Idefics3ImageProcessorPil
    return cls(size={"longest_edge": longest}, max_image_size={"longest_edge": tile}, **kwargs)


def _tokenizer() -> Any:
    from transformers import PreTrainedTokenizerFast

    tok: Tokenizer = train_tokenizer(_CORPUS)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in IDEFICS3_TOKENS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD, model_max_length=1024)


def write_idefics3_model(path: Path, seed: int = 0, family: str = "idefics3") -> Path:
    """A whole tiny Idefics3 checkpoint at `path` (float32) with its processor and template;
    `family` smolvlm: the same model saved by transformers' SmolVLM classes (SmolVLM's config,
    model and image processor: the same computation under another model_type)."""
    import torch
    from transformers import (
        GenerationConfig,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
    )

    path.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer()
    tok.chat_template = IDEFICS3_TEMPLATE
    ids = {"bos_token_id": tok.convert_tokens_to_ids(BOS),
           "eos_token_id": tok.convert_tokens_to_ids(EOS),
           "pad_token_id": tok.convert_tokens_to_ids(PAD)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        smolvlm = family == "smolvlm"
        images = idefics3_image_processor(smolvlm=smolvlm)
        # SmolVLMProcessor needs num2words (for videos; not installed here); its image prompt is
        # Idefics3Processor's (the same get_image_prompt_string), so that one is saved.
        processor = Idefics3Processor(image_processor=images, tokenizer=tok,
                                      image_seq_len=IDEFICS3_SEQ_LEN,
                                      chat_template=IDEFICS3_TEMPLATE)
        processor.save_pretrained(path)
        images.save_pretrained(path)
        text = {**IDEFICS3_TEXT, "vocab_size": len(tok), **ids}
        config = (SmolVLMConfig if smolvlm else Idefics3Config)(
            vision_config=IDEFICS3_VISION, text_config=text, scale_factor=2,
            image_token_id=tok.convert_tokens_to_ids("<image>"), torch_dtype="float32", **ids)
        torch.manual_seed(seed)
        model_class = (SmolVLMForConditionalGeneration if smolvlm
                       else Idefics3ForConditionalGeneration)
        model = model_class(config).eval()
        model.save_pretrained(path, safe_serialization=True)
    GenerationConfig(**ids).save_pretrained(path)
    _set_template(path)
    return path


def _set_template(path: Path) -> None:
    import json

    config_path = path / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config.setdefault("chat_template", IDEFICS3_TEMPLATE)
    config_path.write_text(json.dumps(tokenizer_config))

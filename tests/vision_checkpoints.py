"""The router's files of a tiny Qwen2-VL checkpoint, made from transformers' own classes (no
Hub): config.json from Qwen2VLConfig, preprocessor_config.json saved by its image processor, and
a tokenizer that knows Qwen2-VL's vision tokens. No weights: only the router reads these (the
shards have no vision towers yet), so a test can put them in front of a text model's shards."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from tests.tiny_models import (
    _CORPUS,
    BOS,
    EOS,
    FAMILIES,
    PAD,
    VOCAB_SIZE,
    train_tokenizer,
    write_tokenizer,
)

VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
# A template that places images as Qwen2-VL's does (the image parts of a message's content).
VLM_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MAX_PIXELS = 28 * 28 * 16  # at most 16 patches of 28 x 28: 16 tokens per image


def vision_tokenizer(tokenizer: Tokenizer | None = None) -> Tokenizer:
    """`tokenizer` (default: the tiny models' trained one) with the vision tokens added."""
    tok = tokenizer or train_tokenizer(_CORPUS)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    return tok


def write_qwen2_vl_router_files(path: Path, text_model: Path | None = None,
                                max_pixels: int = MAX_PIXELS) -> Path:
    """`path` made into the router's view of a Qwen2-VL checkpoint; with `text_model`, its
    tokenizer (vision tokens added, so that its other ids stay the text model's)."""
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    path.mkdir(parents=True, exist_ok=True)
    if text_model is not None:
        base = Tokenizer.from_file(str(text_model / "tokenizer.json"))
        shutil.copy(text_model / "tokenizer_config.json", path / "tokenizer_config.json")
        tok = vision_tokenizer(base)
        tok.save(str(path / "tokenizer.json"))
    else:
        write_tokenizer(path, vision_tokenizer(), 256)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = VLM_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        text = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                "num_key_value_heads": 1, "intermediate_size": 32, "vocab_size": 300}
        vision = {"depth": 1, "embed_dim": 16, "hidden_size": 16, "num_heads": 2}
        Qwen2VLConfig(text_config=text, vision_config=vision).save_pretrained(path)
        Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=max_pixels).save_pretrained(path)
    return path



def write_text_model_knowing_vision_tokens(path: Path) -> Path:
    """A tiny random Llama (a text model) whose tokenizer and vocabulary hold Qwen2-VL's vision
    tokens: what a shard serves behind a router that reads the same tokenizer as a Qwen2-VL
    checkpoint's (write_qwen2_vl_router_files), so that prepared images reach the shard."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    path.mkdir(parents=True, exist_ok=True)
    tok = vision_tokenizer()
    spec = dict(FAMILIES["llama"])
    spec.pop("model_type")
    ids = {"bos_token_id": tok.token_to_id(BOS), "eos_token_id": tok.token_to_id(EOS),
           "pad_token_id": tok.token_to_id(PAD)}
    config = AutoConfig.for_model("llama", vocab_size=VOCAB_SIZE + len(VISION_TOKENS),
                                  torch_dtype="float32", **ids, **spec)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path, safe_serialization=True)
    GenerationConfig(**ids).save_pretrained(path)
    write_tokenizer(path, tok, 256)
    return path


# LLaVA-NeXT's image token and a template that places one per image part, as its templates do.
LLAVA_IMAGE_TOKEN = "<image>"
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}[INST] {% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>\n"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message['role'] == 'user' %} [/INST]{% endif %}{% endfor %}"
)
# The tiny tower's tiles: 32 pixels a side in 8-pixel patches (a 4 x 4 grid per tile), and the
# resolutions anyres picks from (1 x 2, 2 x 1 and 2 x 2 tiles).
LLAVA_TILE, LLAVA_PATCH = 32, 8
LLAVA_PINPOINTS = [[32, 64], [64, 32], [64, 64]]


def llava_processor(tile: int = LLAVA_TILE) -> Any:
    """transformers' LLaVA 1.5 image processor (PIL backend) for tiles of `tile` pixels."""
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    return LlavaImageProcessorPil(size={"shortest_edge": tile},
                                  crop_size={"height": tile, "width": tile})


def llava_next_processor(tile: int = LLAVA_TILE, pinpoints: list[list[int]] | None = None
                         ) -> Any:
    """transformers' LLaVA-NeXT image processor (PIL backend) for tiles of `tile` pixels."""
    from transformers.models.llava_next.image_processing_pil_llava_next import (
        LlavaNextImageProcessorPil,
    )

    return LlavaNextImageProcessorPil(
        size={"shortest_edge": tile}, crop_size={"height": tile, "width": tile},
        image_grid_pinpoints=pinpoints or LLAVA_PINPOINTS)


def write_llava_next_tokenizer(path: Path, family: str = "llava_next") -> Tokenizer:
    """The tiny models' tokenizer with `<image>` added, its template LLaVA-NeXT-like, and the
    family's (llava_next or llava) image processor."""
    path.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(_CORPUS)
    tok.add_special_tokens([AddedToken(LLAVA_IMAGE_TOKEN, special=True, normalized=False)])
    write_tokenizer(path, tok, 512)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = LLAVA_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (llava_processor() if family == "llava" else llava_next_processor()).save_pretrained(path)
    return tok

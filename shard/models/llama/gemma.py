"""Gemma, Gemma 2 and Gemma 3 (text) as configurations of the Llama-style decoder.

What Gemma changes: RMSNorm scales by (1 + w); embeddings are multiplied by sqrt(hidden_size)
(rounded to the model dtype); GeGLU (tanh GELU) MLP; head_dim independent of hidden_size; tied
embeddings. Gemma 2 adds sandwich norms (each sub-block's output normed before its residual add),
a softmax scale of query_pre_attn_scalar ** -0.5, attention and final-logit soft-capping, and
alternating sliding-window layers. Gemma 3 drops the soft-capping, adds q/k norms, and gives its
sliding layers their own rope base (rope_local_base_freq, unscaled) in a 5-local-to-1-global
pattern. Defaults for absent keys are transformers' GemmaConfig, Gemma2Config and
Gemma3TextConfig's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from pytgi_shard.models.llama.config import (
    LlamaConfig,
    common_fields,
    read_config,
    windows_of_layer_types,
)

_GEMMA: Mapping[str, Any] = MappingProxyType({
    "vocab_size": 256000, "hidden_size": 3072, "intermediate_size": 24576,
    "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 16,
    "head_dim": 256, "hidden_act": "gelu_pytorch_tanh", "hidden_activation": None,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "rope_scaling": None, "attention_bias": False, "tie_word_embeddings": True,
})
_GEMMA2: Mapping[str, Any] = MappingProxyType({
    **_GEMMA, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "layer_types": None,
    "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
})
_GEMMA3: Mapping[str, Any] = MappingProxyType({
    **_GEMMA2, "vocab_size": 262208, "max_position_embeddings": 131072,
    "rope_theta": 1_000_000.0, "final_logit_softcapping": None, "attn_logit_softcapping": None,
    "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6,
    "use_bidirectional_attention": False,
})


def _gemma_fields(model_type: str, c: Mapping[str, Any]) -> dict[str, Any]:
    fields = common_fields(model_type, c)
    # Gemma's reference uses the tanh GELU; `hidden_activation` names it where `hidden_act`
    # (the legacy key) may still say "gelu" (gemma-7b).
    fields["hidden_act"] = str(c["hidden_activation"] or c["hidden_act"])
    bias = bool(c["attention_bias"])
    fields.update(
        qkv_bias=bias, o_bias=bias, mlp_bias=False, norm="rms_plus_one",
        embedding_normalizer=math.sqrt(int(c["hidden_size"])),
    )
    return fields


def gemma_config(raw: Mapping[str, Any]) -> LlamaConfig:
    c = {**_GEMMA, **raw}

    def build() -> LlamaConfig:
        layers = int(c["num_hidden_layers"])
        return LlamaConfig(**_gemma_fields("gemma", c), layer_windows=(None,) * layers)

    return read_config("gemma", build)


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def gemma2_config(raw: Mapping[str, Any]) -> LlamaConfig:
    c = {**_GEMMA2, **raw}

    def build() -> LlamaConfig:
        layers = int(c["num_hidden_layers"])
        kinds = c["layer_types"] or [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)
        ]
        return LlamaConfig(
            **_gemma_fields("gemma2", c),
            layer_windows=windows_of_layer_types(kinds, c["sliding_window"], layers),
            block="sandwich",
            attention_scale=float(c["query_pre_attn_scalar"]) ** -0.5,
            attn_softcap=_optional_float(c["attn_logit_softcapping"]),
            final_softcap=_optional_float(c["final_logit_softcapping"]),
        )

    return read_config("gemma2", build)


def gemma3_text_config(raw: Mapping[str, Any]) -> LlamaConfig:
    c = {**_GEMMA3, **raw}
    if c["use_bidirectional_attention"]:
        raise ValueError("gemma3_text with use_bidirectional_attention is an encoder, not served")

    def build() -> LlamaConfig:
        layers = int(c["num_hidden_layers"])
        pattern = int(c["sliding_window_pattern"])
        kinds = c["layer_types"] or [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ]
        return LlamaConfig(
            **_gemma_fields("gemma3_text", c),
            layer_windows=windows_of_layer_types(kinds, c["sliding_window"], layers),
            block="sandwich",
            qk_norm="rms_plus_one",
            attention_scale=float(c["query_pre_attn_scalar"]) ** -0.5,
            attn_softcap=_optional_float(c["attn_logit_softcapping"]),
            final_softcap=_optional_float(c["final_logit_softcapping"]),
            local_rope_theta=float(c["rope_local_base_freq"]),
        )

    return read_config("gemma3_text", build)

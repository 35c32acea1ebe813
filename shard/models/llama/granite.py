"""Granite (IBM, dense) as a configuration of the Llama-style decoder.

What Granite changes: four plain multipliers, applied where its training applied them:
embeddings times embedding_multiplier, each residual branch times residual_multiplier, the softmax
scale is attention_multiplier itself (not head_dim ** -0.5), and logits divided by logits_scaling.
Defaults for absent keys are transformers' GraniteConfig's.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from pytgi_shard.models.llama.config import LlamaConfig, common_fields, read_config

_GRANITE: Mapping[str, Any] = MappingProxyType({
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
    "head_dim": None, "hidden_act": "silu", "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "embedding_multiplier": 1.0, "residual_multiplier": 1.0, "attention_multiplier": 1.0,
    "logits_scaling": 1.0,
})


def granite_config(raw: Mapping[str, Any]) -> LlamaConfig:
    c = {**_GRANITE, **raw}

    def build() -> LlamaConfig:
        bias = bool(c["attention_bias"])
        return LlamaConfig(
            **common_fields("granite", c),
            qkv_bias=bias, o_bias=bias, mlp_bias=bool(c["mlp_bias"]),
            layer_windows=(None,) * int(c["num_hidden_layers"]),
            embedding_multiplier=float(c["embedding_multiplier"]),
            residual_multiplier=float(c["residual_multiplier"]),
            attention_scale=float(c["attention_multiplier"]),
            logit_scale=1.0 / float(c["logits_scaling"]),
        )

    return read_config("granite", build)

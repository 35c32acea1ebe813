"""Cohere (Command-R) as a configuration of the Llama-style decoder.

What Cohere changes: a bias-free LayerNorm instead of RMSNorm, attention and MLP side by side on
one norm's output (x + attn(norm(x)) + mlp(norm(x))), rotary over adjacent dimension pairs, an
optional q/k LayerNorm with a weight per head (use_qk_norm, Command-R+), logits times
logit_scale, tied embeddings. Defaults for absent keys are transformers' CohereConfig's.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from pytgi_shard.models.llama.config import LlamaConfig, common_fields, read_config

_COHERE: Mapping[str, Any] = MappingProxyType({
    "vocab_size": 256000, "hidden_size": 8192, "intermediate_size": 22528,
    "num_hidden_layers": 40, "num_attention_heads": 64, "num_key_value_heads": None,
    "head_dim": None, "hidden_act": "silu", "max_position_embeddings": 8192,
    "layer_norm_eps": 1e-5, "logit_scale": 0.0625, "rope_theta": 10000.0, "rope_scaling": None,
    "attention_bias": False, "use_qk_norm": False, "tie_word_embeddings": True,
})


def cohere_config(raw: Mapping[str, Any]) -> LlamaConfig:
    c = {**_COHERE, **raw}

    def build() -> LlamaConfig:
        # The decoder's norm epsilon, whatever the norm; Cohere names it layer_norm_eps.
        fields = common_fields("cohere", {**c, "rms_norm_eps": c["layer_norm_eps"]})
        bias = bool(c["attention_bias"])
        return LlamaConfig(
            **fields,
            qkv_bias=bias, o_bias=bias, mlp_bias=False,
            layer_windows=(None,) * int(c["num_hidden_layers"]),
            norm="layer_no_bias",
            qk_norm="head_layer" if c["use_qk_norm"] else None,
            block="parallel",
            rope_interleaved=True,
            logit_scale=float(c["logit_scale"]),
        )

    return read_config("cohere", build)

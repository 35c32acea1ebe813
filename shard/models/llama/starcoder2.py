"""StarCoder2 as a configuration of the Llama-style decoder.

What StarCoder2 changes: LayerNorm with bias instead of RMSNorm, a plain (non-gated) GELU MLP
named c_fc / c_proj, a bias on every projection (use_bias), and a sliding window on every layer.
Defaults for absent keys are transformers' Starcoder2Config's.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from pytgi_shard.models.llama.config import LlamaConfig, common_fields, read_config

_STARCODER2: Mapping[str, Any] = MappingProxyType({
    "vocab_size": 49152, "hidden_size": 3072, "intermediate_size": 12288,
    "num_hidden_layers": 30, "num_attention_heads": 24, "num_key_value_heads": 2,
    "head_dim": None, "hidden_act": "gelu_pytorch_tanh", "max_position_embeddings": 4096,
    "norm_epsilon": 1e-5, "rope_theta": 10000.0, "rope_scaling": None, "sliding_window": None,
    "use_bias": True, "tie_word_embeddings": True,
})


def starcoder2_config(raw: Mapping[str, Any]) -> LlamaConfig:
    c = {**_STARCODER2, **raw}

    def build() -> LlamaConfig:
        # The decoder's norm epsilon, whatever the norm; StarCoder2 names it norm_epsilon.
        fields = common_fields("starcoder2", {**c, "rms_norm_eps": c["norm_epsilon"]})
        bias = bool(c["use_bias"])
        window = c["sliding_window"]
        layers = int(c["num_hidden_layers"])
        return LlamaConfig(
            **fields,
            qkv_bias=bias, o_bias=bias, mlp_bias=bias,
            layer_windows=(int(window) if window else None,) * layers,
            norm="layer",
            mlp="plain",
        )

    return read_config("starcoder2", build)

"""Phi-3 and Phi-4 as a configuration of the Llama-style decoder.

What Phi-3 changes: the checkpoint fuses q/k/v into one qkv_proj and gate/up into one
gate_up_proj (sliced per rank when loaded), long-context variants rotate with LongRoPE (short
and long per-frequency factors, `su` and `yarn` being its older names in Phi-3 configs), Phi-4-mini
rotates only part of each head (partial_rotary_factor), and the mini models attend within a
sliding window. Defaults for absent keys are transformers' Phi3Config's.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from pytgi_shard.models.llama.config import LlamaConfig, common_fields, read_config

_PHI3: Mapping[str, Any] = MappingProxyType({
    "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
    "head_dim": None, "hidden_act": "silu", "max_position_embeddings": 4096,
    "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "rope_scaling": None, "partial_rotary_factor": 1.0, "sliding_window": None,
    "tie_word_embeddings": False,
})
_LONGROPE_NAMES = ("longrope", "su", "yarn")


def _rope_scaling(c: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """Phi-3's rope_scaling with LongRoPE's name and the pretraining context it switches at."""
    scaling = c["rope_scaling"]
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in _LONGROPE_NAMES:
        return dict(scaling)
    original = c["original_max_position_embeddings"]
    return {**scaling, "rope_type": "longrope", "original_max_position_embeddings": original}


def phi3_config(raw: Mapping[str, Any]) -> LlamaConfig:
    c = {**_PHI3, **raw}

    def build() -> LlamaConfig:
        fields = common_fields("phi3", c)
        fields["rope_scaling"] = _rope_scaling(c)
        window = c["sliding_window"]
        layers = int(c["num_hidden_layers"])
        return LlamaConfig(
            **fields,
            qkv_bias=False, o_bias=False, mlp_bias=False,
            layer_windows=(int(window) if window else None,) * layers,
            fused_qkv=True,
            mlp="fused_gated",
            rotary_dim=int(fields["head_dim"] * float(c["partial_rotary_factor"])),
        )

    return read_config("phi3", build)

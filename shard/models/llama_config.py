"""The typed configuration of a Llama-family checkpoint, built from its config.json.

Read directly (not through transformers' config classes) so that a shard serving our own
implementation never imports transformers, which costs seconds at every start. The defaults
for absent keys are those of transformers' LlamaConfig, MistralConfig and Qwen2Config, which the
checkpoints were written against; a test holds the two readings equal.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

_COMMON: Mapping[str, Any] = MappingProxyType({
    "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "rope_scaling": None, "tie_word_embeddings": False, "head_dim": None,
})
FAMILY_DEFAULTS: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    "llama": {**_COMMON, "intermediate_size": 11008, "num_key_value_heads": None,
              "max_position_embeddings": 2048, "attention_bias": False, "mlp_bias": False},
    "mistral": {**_COMMON, "intermediate_size": 14336, "num_key_value_heads": 8,
                "max_position_embeddings": 131072, "sliding_window": 4096},
    "qwen2": {**_COMMON, "vocab_size": 151936, "intermediate_size": 22016,
              "num_key_value_heads": 32, "max_position_embeddings": 32768,
              "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
              "layer_types": None},
})


@dataclass(frozen=True)
class LlamaConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Mapping[str, Any] | None
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    # The sliding window of each layer; None where the layer attends to its whole context.
    layer_windows: tuple[int | None, ...]

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> LlamaConfig:
        model_type = raw.get("model_type")
        if not isinstance(model_type, str) or model_type not in FAMILY_DEFAULTS:
            families = ", ".join(FAMILY_DEFAULTS)
            raise ValueError(f"{model_type!r} is not a Llama-family model ({families})")
        c = {**FAMILY_DEFAULTS[model_type], **raw}
        try:
            return cls._build(model_type, c)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"invalid {model_type} config.json: {e!r}") from e

    @classmethod
    def _build(cls, model_type: str, c: Mapping[str, Any]) -> LlamaConfig:
        heads = int(c["num_attention_heads"])
        qwen2 = model_type == "qwen2"
        attention_bias = bool(c.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=int(c["vocab_size"]),
            hidden_size=int(c["hidden_size"]),
            intermediate_size=int(c["intermediate_size"]),
            num_hidden_layers=int(c["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(c["num_key_value_heads"] or heads),
            head_dim=int(c["head_dim"] or int(c["hidden_size"]) // heads),
            hidden_act=str(c["hidden_act"]),
            max_position_embeddings=int(c["max_position_embeddings"]),
            rms_norm_eps=float(c["rms_norm_eps"]),
            rope_theta=float(c["rope_theta"]),
            rope_scaling=c["rope_scaling"] or None,
            tie_word_embeddings=bool(c["tie_word_embeddings"]),
            # Qwen2 always has q/k/v bias and never an o_proj bias.
            qkv_bias=qwen2 or attention_bias,
            o_bias=not qwen2 and attention_bias,
            mlp_bias=bool(c.get("mlp_bias", False)),
            layer_windows=_layer_windows(model_type, c),
        )


def _layer_windows(model_type: str, c: Mapping[str, Any]) -> tuple[int | None, ...]:
    layers = int(c["num_hidden_layers"])
    if model_type == "mistral":
        window = c["sliding_window"]
        return (int(window) if window else None,) * layers
    if model_type == "qwen2":
        window = c["sliding_window"] if c["use_sliding_window"] else None
        kinds = c["layer_types"] or [
            "sliding_attention" if window is not None and i >= c["max_window_layers"]
            else "full_attention"
            for i in range(layers)
        ]
        if len(kinds) != layers:
            raise ValueError(f"layer_types has {len(kinds)} entries for {layers} layers")
        return tuple(int(window) if window and k == "sliding_attention" else None for k in kinds)
    return (None,) * layers

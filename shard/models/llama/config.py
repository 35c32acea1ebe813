"""The typed configuration of a Llama-style decoder checkpoint, built from its config.json.

Read directly (not through transformers' config classes) so that a shard serving our own
implementation never imports transformers, which costs seconds at every start. The defaults
for absent keys are those of transformers' config class of each family, which the checkpoints
were written against; tests hold the two readings equal.

LlamaConfig describes every family the decoder in llama.py runs: Llama itself, and the
variations the others make to it (norm kind, q/k norms, multipliers, soft-capping, sandwich or
parallel blocks, fused checkpoint tensors). Each family's reader fills it from its own keys:
`from_dict` here (Llama, Mistral, Qwen2, Qwen3), and one module per other family.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

from pytgi_shard.layers.moe import MoESpec

_COMMON: Mapping[str, Any] = MappingProxyType({
    "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "rope_scaling": None, "tie_word_embeddings": False, "head_dim": None,
})
_QWEN: Mapping[str, Any] = MappingProxyType({
    **_COMMON, "vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
    "max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": 4096,
    "max_window_layers": 28, "layer_types": None,
})
FAMILY_DEFAULTS: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    "llama": {**_COMMON, "intermediate_size": 11008, "num_key_value_heads": None,
              "max_position_embeddings": 2048, "attention_bias": False, "mlp_bias": False},
    "mistral": {**_COMMON, "intermediate_size": 14336, "num_key_value_heads": 8,
                "max_position_embeddings": 131072, "sliding_window": 4096},
    "qwen2": dict(_QWEN),
    "qwen3": {**_QWEN, "intermediate_size": 22016, "head_dim": 128, "attention_bias": False},
})

# "rms": x / rms(x) * w; "rms_plus_one": Gemma's (1 + w); "layer": LayerNorm with bias;
# "layer_no_bias": Cohere's LayerNorm; "head_layer": Cohere's per-head q/k LayerNorm.
NormKind = Literal["rms", "rms_plus_one", "layer", "layer_no_bias", "head_layer"]
# "gated": gate_proj/up_proj/down_proj; "fused_gated": Phi-3's gate_up_proj/down_proj;
# "plain": StarCoder2's c_fc/c_proj, no gate.
MLPKind = Literal["gated", "fused_gated", "plain"]
# "pre": Llama's x + attn(norm(x)), then x + mlp(norm(x)); "sandwich": Gemma 2/3, each
# sub-block's output normed again before its residual add; "parallel": Cohere,
# x + attn(norm(x)) + mlp(norm(x)).
BlockKind = Literal["pre", "sandwich", "parallel"]


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
    norm: NormKind = "rms"
    # Per-head norm of q and k before the rotation (Qwen3, Gemma 3, Cohere); None: none.
    qk_norm: NormKind | None = None
    block: BlockKind = "pre"
    mlp: MLPKind = "gated"
    # Phi-3's fused qkv_proj instead of q_proj, k_proj, v_proj.
    fused_qkv: bool = False
    # Gemma: embeddings times sqrt(hidden_size), the factor rounded to the model dtype as trained.
    embedding_normalizer: float | None = None
    # Granite: embeddings, residual branches and (reciprocally) logits scaled by plain floats.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logit_scale: float = 1.0
    # The softmax scale (Gemma's query_pre_attn_scalar, Granite's attention_multiplier);
    # None: head_dim ** -0.5.
    attention_scale: float | None = None
    # Gemma 2: scores and final logits bounded as cap * tanh(x / cap).
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # Dimensions of each head that rotate (Phi-4-mini's partial_rotary_factor); None: all.
    rotary_dim: int | None = None
    # Cohere rotates adjacent pairs (2i, 2i + 1) instead of (i, i + head_dim / 2).
    rope_interleaved: bool = False
    # Gemma 3: the sliding layers' own rope base (no scaling); None: every layer shares one.
    local_rope_theta: float | None = None
    # Mixtral, Qwen2-MoE, Qwen3-MoE: sparse mixture-of-experts blocks in the layers it marks.
    moe: MoESpec | None = None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> LlamaConfig:
        """Llama, Mistral, Qwen2 and Qwen3 (which adds q/k RMSNorm to Qwen2's decoder)."""
        model_type = raw.get("model_type")
        if not isinstance(model_type, str) or model_type not in FAMILY_DEFAULTS:
            families = ", ".join(FAMILY_DEFAULTS)
            raise ValueError(f"{model_type!r} is not a Llama-family model ({families})")
        c = {**FAMILY_DEFAULTS[model_type], **raw}
        return read_config(model_type, lambda: cls._build(model_type, c))

    @classmethod
    def _build(cls, model_type: str, c: Mapping[str, Any]) -> LlamaConfig:
        qwen2 = model_type == "qwen2"
        attention_bias = bool(c.get("attention_bias", False))
        return cls(
            **common_fields(model_type, c),
            # Qwen2 always has q/k/v bias and never an o_proj bias.
            qkv_bias=qwen2 or attention_bias,
            o_bias=not qwen2 and attention_bias,
            mlp_bias=bool(c.get("mlp_bias", False)),
            layer_windows=_layer_windows(model_type, c),
            qk_norm="rms" if model_type == "qwen3" else None,
        )


def read_config(model_type: str, build: Any) -> LlamaConfig:
    """build(), with a missing or mistyped key reported as an invalid config.json."""
    try:
        config: LlamaConfig = build()
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"invalid {model_type} config.json: {e!r}") from e
    return config


def common_fields(model_type: str, c: Mapping[str, Any]) -> dict[str, Any]:
    """The fields every family names alike, from config.json `c` over the family's defaults."""
    heads = int(c["num_attention_heads"])
    return {
        "model_type": model_type,
        "vocab_size": int(c["vocab_size"]),
        "hidden_size": int(c["hidden_size"]),
        "intermediate_size": int(c["intermediate_size"]),
        "num_hidden_layers": int(c["num_hidden_layers"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(c["num_key_value_heads"] or heads),
        "head_dim": int(c["head_dim"] or int(c["hidden_size"]) // heads),
        "hidden_act": str(c["hidden_act"]),
        "max_position_embeddings": int(c["max_position_embeddings"]),
        "rms_norm_eps": float(c["rms_norm_eps"]),
        "rope_theta": float(c["rope_theta"]),
        "rope_scaling": c["rope_scaling"] or None,
        "tie_word_embeddings": bool(c["tie_word_embeddings"]),
    }


def windows_of_layer_types(
    layer_types: list[str], window: int | None, layers: int
) -> tuple[int | None, ...]:
    """Each layer's window from transformers' layer_types ("sliding_attention" layers slide)."""
    if len(layer_types) != layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {layers} layers")
    return tuple(
        int(window) if window and kind == "sliding_attention" else None for kind in layer_types
    )


def _layer_windows(model_type: str, c: Mapping[str, Any]) -> tuple[int | None, ...]:
    layers = int(c["num_hidden_layers"])
    if model_type == "mistral":
        window = c["sliding_window"]
        return (int(window) if window else None,) * layers
    if model_type in ("qwen2", "qwen3"):
        window = c["sliding_window"] if c["use_sliding_window"] else None
        kinds = c["layer_types"] or [
            "sliding_attention" if window is not None and i >= c["max_window_layers"]
            else "full_attention"
            for i in range(layers)
        ]
        return windows_of_layer_types(kinds, window, layers)
    return (None,) * layers

"""Mixtral, Qwen2-MoE and Qwen3-MoE as configurations of the Llama-style decoder with sparse
mixture-of-experts blocks in place of (some of) its MLPs (layers/moe.py).

What each changes, beyond the MoE block:
- Mixtral: Mistral's decoder; every layer's `block_sparse_moe` routes to num_experts_per_tok of
  num_local_experts experts (w1 gate, w3 up, w2 down), top-k weights always renormalised.
- Qwen2-MoE: Qwen2's decoder (q/k/v bias per qkv_bias); `mlp` experts of moe_intermediate_size,
  renormalised only with norm_topk_prob, plus a shared expert scaled by
  sigmoid(shared_expert_gate(x)). Layers in mlp_only_layers, or off the decoder_sparse_step
  stride, have a dense MLP of intermediate_size.
- Qwen3-MoE: Qwen3's decoder (q/k RMSNorm, attention_bias on all four projections); Qwen2-MoE's
  blocks without the shared expert.

Defaults for absent keys are transformers' MixtralConfig, Qwen2MoeConfig and Qwen3MoeConfig's
(4.57): Qwen3-MoE's norm_topk_prob defaults to False there, though the released Qwen3-MoE
checkpoints all set it true in their config.json.

Sliding windows: Mixtral and Qwen3-MoE slide every layer when configured. Qwen2-MoE, with
use_sliding_window, also slides every layer: transformers' eager and SDPA paths mask every layer
(only its flash-attention path spares the layers below max_window_layers); the released
checkpoints do not use a window.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from pytgi_shard.layers.expert_partition import ExpertNames
from pytgi_shard.layers.moe import MoESpec
from pytgi_shard.models.llama.config import LlamaConfig, common_fields, read_config

_MIXTRAL: Mapping[str, Any] = MappingProxyType({
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": None, "hidden_act": "silu", "max_position_embeddings": 4096 * 32,
    "rms_norm_eps": 1e-5, "rope_theta": 1e6, "rope_scaling": None, "tie_word_embeddings": False,
    "sliding_window": None, "num_experts_per_tok": 2, "num_local_experts": 8,
})
_QWEN_MOE: Mapping[str, Any] = MappingProxyType({
    "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 24, "head_dim": None,
    "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "rope_scaling": None, "tie_word_embeddings": False,
    "use_sliding_window": False, "sliding_window": 4096, "decoder_sparse_step": 1,
    "norm_topk_prob": False, "mlp_only_layers": None,
})
_QWEN2_MOE: Mapping[str, Any] = MappingProxyType({
    **_QWEN_MOE, "intermediate_size": 5632, "num_attention_heads": 16, "num_key_value_heads": 16,
    "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
    "num_experts_per_tok": 4, "num_experts": 60, "qkv_bias": True,
})
_QWEN3_MOE: Mapping[str, Any] = MappingProxyType({
    **_QWEN_MOE, "intermediate_size": 6144, "num_attention_heads": 32, "num_key_value_heads": 4,
    "moe_intermediate_size": 768, "num_experts_per_tok": 8, "num_experts": 128,
    "attention_bias": False,
})
_QWEN_EXPERTS = ExpertNames("gate_proj", "up_proj", "down_proj")


def mixtral_config(raw: Mapping[str, Any]) -> LlamaConfig:
    c = {**_MIXTRAL, **raw}

    def build() -> LlamaConfig:
        layers = int(c["num_hidden_layers"])
        window = c["sliding_window"]
        moe = MoESpec(
            num_experts=int(c["num_local_experts"]), top_k=int(c["num_experts_per_tok"]),
            intermediate_size=int(c["intermediate_size"]), renormalize=True,
            sparse_layers=(True,) * layers, module="block_sparse_moe",
            names=ExpertNames("w1", "w3", "w2"),
        )
        return LlamaConfig(
            **common_fields("mixtral", c), qkv_bias=False, o_bias=False, mlp_bias=False,
            layer_windows=(int(window) if window else None,) * layers, moe=moe,
        )

    return read_config("mixtral", build)


def qwen2_moe_config(raw: Mapping[str, Any]) -> LlamaConfig:
    c = {**_QWEN2_MOE, **raw}

    def build() -> LlamaConfig:
        return LlamaConfig(
            **common_fields("qwen2_moe", c), qkv_bias=bool(c["qkv_bias"]), o_bias=False,
            mlp_bias=False, layer_windows=_qwen_windows(c),
            moe=_qwen_moe(c, int(c["shared_expert_intermediate_size"])),
        )

    return read_config("qwen2_moe", build)


def qwen3_moe_config(raw: Mapping[str, Any]) -> LlamaConfig:
    c = {**_QWEN3_MOE, **raw}

    def build() -> LlamaConfig:
        bias = bool(c["attention_bias"])
        return LlamaConfig(
            **common_fields("qwen3_moe", c), qkv_bias=bias, o_bias=bias, mlp_bias=False,
            layer_windows=_qwen_windows(c), qk_norm="rms", moe=_qwen_moe(c, 0),
        )

    return read_config("qwen3_moe", build)


def _qwen_moe(c: Mapping[str, Any], shared: int) -> MoESpec:
    """Qwen's blocks: sparse in layer i when i is not in mlp_only_layers and (i + 1) is a
    multiple of decoder_sparse_step (and there are experts at all)."""
    experts, step = int(c["num_experts"]), int(c["decoder_sparse_step"])
    dense = set(c["mlp_only_layers"] or ())
    sparse = tuple(
        i not in dense and experts > 0 and (i + 1) % step == 0
        for i in range(int(c["num_hidden_layers"]))
    )
    return MoESpec(
        num_experts=experts, top_k=int(c["num_experts_per_tok"]),
        intermediate_size=int(c["moe_intermediate_size"]), renormalize=bool(c["norm_topk_prob"]),
        sparse_layers=sparse, module="mlp", names=_QWEN_EXPERTS, shared_intermediate_size=shared,
    )


def _qwen_windows(c: Mapping[str, Any]) -> tuple[int | None, ...]:
    window = c["sliding_window"] if c["use_sliding_window"] else None
    return (int(window) if window else None,) * int(c["num_hidden_layers"])

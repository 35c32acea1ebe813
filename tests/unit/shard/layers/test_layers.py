"""Layers, config and weights against transformers' definitions and the files on disk."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig
from transformers import LlamaConfig as HFLlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from pytgi_shard.device.distributed import Dist
from pytgi_shard.layers.layernorm import RMSNorm
from pytgi_shard.layers.linear import kv_head_partition
from pytgi_shard.layers.rotary import (
    RotaryEmbedding,
    apply_rotary,
    rope_type_of,
    rotation_tables,
)
from pytgi_shard.models.llama.config import LlamaConfig
from pytgi_shard.models.model_config import ModelConfig
from pytgi_shard.weights.reader import Weights
from tests.hf_config import hf_fields

CPU = torch.device("cpu")


def rank(r: int, world: int) -> Dist:
    """A rank's identity; loading never communicates, so no process group is needed."""
    return Dist(rank=r, world_size=world, device=CPU, group=None)


# --- config -----------------------------------------------------------------------------------

CONFIG_VARIANTS: list[dict[str, Any]] = [
    {"model_type": "llama"},
    {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 8, "attention_bias": True,
     "mlp_bias": True, "rope_scaling": {"type": "linear", "factor": 2.0}},
    {"model_type": "mistral"},
    {"model_type": "mistral", "sliding_window": None, "head_dim": 32},
    {"model_type": "qwen2"},
    {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8,
     "max_window_layers": 1, "num_hidden_layers": 3},
]


def hf_windows(hf: Any) -> list[int | None]:
    if hf.model_type == "qwen2":
        return [hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types]
    return [getattr(hf, "sliding_window", None)] * hf.num_hidden_layers


def assert_same_config(ours: LlamaConfig, hf: Any) -> None:
    fields = hf_fields(hf)
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "hidden_act",
                 "max_position_embeddings", "rms_norm_eps", "rope_theta", "tie_word_embeddings"):
        assert getattr(ours, name) == fields[name], name
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert ours.head_dim == head_dim
    hf_scaling = fields.get("rope_scaling")
    assert rope_type_of(ours.rope_scaling) == rope_type_of(hf_scaling)
    if hf_scaling:
        assert ours.rope_scaling is not None
        assert ours.rope_scaling["factor"] == hf_scaling["factor"]
    assert list(ours.layer_windows) == hf_windows(hf)
    if hf.model_type == "llama":
        assert (ours.qkv_bias, ours.o_bias, ours.mlp_bias) == (
            hf.attention_bias, hf.attention_bias, hf.mlp_bias
        )


@pytest.mark.parametrize("raw", CONFIG_VARIANTS)
def test_config_defaults_match_transformers(raw: dict[str, Any]) -> None:
    fields = {k: v for k, v in raw.items() if k != "model_type"}
    hf = AutoConfig.for_model(raw["model_type"], **json.loads(json.dumps(fields)))
    assert_same_config(LlamaConfig.from_dict(json.loads(json.dumps(raw))), hf)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_config_of_tiny_models(tiny_model: Callable[..., Path], family: str) -> None:
    path = tiny_model(family)
    ours = LlamaConfig.from_dict(ModelConfig.read(path).raw)
    assert_same_config(ours, AutoConfig.from_pretrained(path))
    assert ours.qkv_bias == (family == "qwen2")


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="'gpt2' is not a Llama-family model"):
        LlamaConfig.from_dict({"model_type": "gpt2"})
    with pytest.raises(ValueError, match="invalid llama config.json"):
        LlamaConfig.from_dict({"model_type": "llama", "hidden_size": "big"})
    with pytest.raises(ValueError, match="layer_types has 1 entries for 2 layers"):
        LlamaConfig.from_dict(
            {"model_type": "qwen2", "num_hidden_layers": 2, "layer_types": ["full_attention"]}
        )


# --- rotary -----------------------------------------------------------------------------------

ROPE_SCALINGS: list[dict[str, Any] | None] = [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16, "beta_slow": 2, "mscale": 0.9,
     "mscale_all_dim": 0.7},
]


THETA = 500000.0


def hf_rope_config(scaling: dict[str, Any] | None, theta: float = THETA) -> HFLlamaConfig:
    return HFLlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=128,
                         rope_theta=theta, rope_scaling=scaling)


def hf_cos_sin(config: HFLlamaConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rotary = LlamaRotaryEmbedding(config)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions.unsqueeze(0))
    half = cos.shape[-1] // 2
    return cos[0, :, :half], sin[0, :, :half]


@pytest.mark.parametrize("scaling", ROPE_SCALINGS)
def test_rotary_matches_transformers(scaling: dict[str, Any] | None) -> None:
    config = hf_rope_config(scaling)
    ours = RotaryEmbedding(64, THETA, 128, scaling, CPU)
    positions = torch.tensor([0, 1, 5, 31, 32, 100, 127, 500])
    cos, sin = ours.cos_sin(positions)
    expected_cos, expected_sin = hf_cos_sin(config, positions)
    torch.testing.assert_close(cos, expected_cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, expected_sin, atol=1e-6, rtol=0)


def test_dynamic_rotary_matches_transformers_decoding_one_sequence() -> None:
    """Dynamic NTK grows the base past max_position_embeddings: per token, as one sequence sees."""
    scaling = {"rope_type": "dynamic", "factor": 2.0}
    config = hf_rope_config(scaling, theta=10000.0)
    ours = RotaryEmbedding(64, 10000.0, 128, scaling, CPU)
    positions = torch.tensor([0, 50, 127, 128, 200, 400])
    cos, sin = ours.cos_sin(positions)
    for i, p in enumerate(positions.tolist()):
        # transformers scales by the longest position of its batch: a batch of one token here.
        expected_cos, expected_sin = hf_cos_sin(config, torch.tensor([p]))
        torch.testing.assert_close(cos[i : i + 1], expected_cos, atol=1e-6, rtol=0)
        torch.testing.assert_close(sin[i : i + 1], expected_sin, atol=1e-6, rtol=0)
    assert not torch.allclose(cos[-1], RotaryEmbedding(64, 10000.0, 128, None, CPU).cos_sin(
        positions[-1:])[0][0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rotary_matches_transformers(dtype: torch.dtype) -> None:
    config = hf_rope_config(ROPE_SCALINGS[2])
    positions = torch.arange(9) * 7
    q, k = torch.randn(9, 4, 64, dtype=dtype), torch.randn(9, 2, 64, dtype=dtype)
    cos, sin = RotaryEmbedding(64, THETA, 128, ROPE_SCALINGS[2], CPU).cos_sin(positions)
    rotary = LlamaRotaryEmbedding(config)
    hf_cos, hf_sin = rotary(q, positions.unsqueeze(0))
    # transformers' layout is [batch, heads, tokens, dim].
    hf_q, hf_k = apply_rotary_pos_emb(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), hf_cos, hf_sin
    )
    tables = rotation_tables(cos, sin, dtype)
    got_q = apply_rotary(q, *tables)
    got_k = apply_rotary(k, *tables)
    torch.testing.assert_close(got_q, hf_q[0].transpose(0, 1), atol=1e-5, rtol=0)
    torch.testing.assert_close(got_k, hf_k[0].transpose(0, 1), atol=1e-5, rtol=0)


def test_rotary_config_errors() -> None:
    with pytest.raises(ValueError, match="rope_scaling type 'mrope' is not supported"):
        RotaryEmbedding(64, 1e4, 128, {"rope_type": "mrope", "factor": 2.0}, CPU)
    with pytest.raises(ValueError, match="'longrope' lacks the key 'short_factor'"):
        RotaryEmbedding(64, 1e4, 128, {"rope_type": "longrope", "factor": 2.0}, CPU)
    with pytest.raises(ValueError, match="'llama3' lacks the key 'low_freq_factor'"):
        RotaryEmbedding(64, 1e4, 128, {"rope_type": "llama3", "factor": 8.0}, CPU)


# --- norm, partition --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers(dtype: torch.dtype) -> None:
    weight = torch.randn(48).to(dtype)
    hf = LlamaRMSNorm(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(weight)
    x = (torch.randn(5, 48) * 3).to(dtype)
    assert torch.equal(RMSNorm(weight, 1e-5)(x), hf(x))


def test_kv_head_partition() -> None:
    assert kv_head_partition(8, rank(3, 4)) == (3, 4)  # split: two heads per rank
    assert kv_head_partition(2, rank(3, 4)) == (1, 2)  # replicated: ranks 2 and 3 share head 1
    assert kv_head_partition(1, rank(1, 2)) == (0, 1)
    with pytest.raises(ValueError, match="3 key/value heads cannot be split or replicated over 2"):
        kv_head_partition(3, rank(0, 2))


# --- weights ----------------------------------------------------------------------------------


def test_weights_read_each_ranks_slice(tiny_model: Callable[..., Path]) -> None:
    path = tiny_model("llama", sharded=True)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    whole = Weights(path, torch.float32, rank(0, 1))
    assert whole.names() == sorted(index["weight_map"])
    name = "model.layers.1.mlp.down_proj.weight"
    full = whole.get_tensor(name)
    for r in range(2):
        part = Weights(path, torch.bfloat16, rank(r, 2))
        assert torch.equal(part.get_sharded(name, 0), full.chunk(2, 0)[r].bfloat16())
        assert torch.equal(part.get_sharded(name, 1), full.chunk(2, 1)[r].bfloat16())
        assert part.get_sharded(name, 1).dtype == torch.bfloat16


def test_weights_errors(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(3, 4), "step": torch.arange(3)}, tmp_path / "one.safetensors")
    weights = Weights(tmp_path, torch.bfloat16, rank(0, 2))
    assert weights.get_tensor("step").dtype == torch.int64  # integers are not cast
    with pytest.raises(ValueError, match="weight 'missing.weight' not found in the checkpoint"):
        weights.get_tensor("missing.weight")
    with pytest.raises(ValueError, match="'a' has 3 rows along dim 0, which do not split into 2"):
        weights.get_sharded("a", 0)
    save_file({"a": torch.ones(1)}, tmp_path / "two.safetensors")
    with pytest.raises(ValueError, match="tensor 'a' is in both one.safetensors and two"):
        Weights(tmp_path, torch.float32, rank(0, 1))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "gone.safetensors"}})
    )
    with pytest.raises(ValueError, match="names files that do not exist"):
        Weights(tmp_path, torch.float32, rank(0, 1))
    with pytest.raises(ValueError, match="no safetensors weights"):
        Weights(tmp_path / "..", torch.float32, rank(0, 1))


def test_single_file_checkpoint_ignores_other_safetensors(tmp_path: Path) -> None:
    """Hub repos may carry another format's file beside model.safetensors (Mistral's)."""
    save_file({"w": torch.ones(2)}, tmp_path / "model.safetensors")
    save_file({"w": torch.zeros(2)}, tmp_path / "consolidated.safetensors")
    weights = Weights(tmp_path, torch.float32, rank(0, 1))
    assert torch.equal(weights.get_tensor("w"), torch.ones(2))

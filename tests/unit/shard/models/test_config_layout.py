"""config.json written by transformers 5 reads as the same model as its transformers 4 twin.

Literal files, as each version writes them for the same model (so this holds whichever
transformers is installed); the suite's tiny models are written by the installed one, and the
model tests compare their logits with it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pytgi_shard.models.config_layout import legacy_layout
from pytgi_shard.models.gpt_neox import GPTNeoXConfig
from pytgi_shard.models.llama.config import LlamaConfig
from pytgi_shard.models.llama.gemma import gemma3_text_config
from pytgi_shard.models.llama.moe import qwen3_moe_config
from pytgi_shard.models.llama.phi3 import phi3_config
from pytgi_shard.models.model_config import ModelConfig
from pytgi_shard.models.t5_config import T5Config

SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
         "max_position_embeddings": 256}  # fmt: skip
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}  # fmt: skip
LONGROPE = {"type": "longrope", "short_factor": [1.0, 1.5], "long_factor": [2.0, 4.0]}

# (reader, transformers 4's file, transformers 5's file) for one model each.
TWINS: dict[str, tuple[Any, dict[str, Any], dict[str, Any]]] = {
    "llama3 scaling": (
        LlamaConfig.from_dict,
        {**SHAPE, "model_type": "llama", "rope_theta": 500000.0, "rope_scaling": LLAMA3},
        {**SHAPE, "model_type": "llama", "rope_parameters": {**LLAMA3, "rope_theta": 500000.0}},
    ),
    "no scaling": (
        LlamaConfig.from_dict,
        {**SHAPE, "model_type": "qwen2", "rope_theta": 1e6, "rope_scaling": None},
        {**SHAPE, "model_type": "qwen2",
         "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    ),
    "gemma 3, per layer type": (
        gemma3_text_config,
        {**SHAPE, "model_type": "gemma3_text", "rope_theta": 1e6, "rope_local_base_freq": 1e4,
         "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "sliding_window": 5},
        {**SHAPE, "model_type": "gemma3_text", "sliding_window": 5, "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
    ),
    "phi-3 longrope, partial rotary": (
        phi3_config,
        {**SHAPE, "model_type": "phi3", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
         "original_max_position_embeddings": 64, "rope_scaling": LONGROPE},
        {**SHAPE, "model_type": "phi3", "original_max_position_embeddings": 64,
         "rope_parameters": {**LONGROPE, "rope_type": "longrope", "rope_theta": 1e4,
                             "partial_rotary_factor": 0.5,
                             "original_max_position_embeddings": 64}},
    ),
    "gpt-neox rotary_pct": (
        GPTNeoXConfig.from_dict,
        {**SHAPE, "model_type": "gpt_neox", "rotary_pct": 0.25, "rotary_emb_base": 20000},
        {**SHAPE, "model_type": "gpt_neox", "rope_parameters": {
            "rope_type": "default", "rope_theta": 20000.0, "partial_rotary_factor": 0.25}},
    ),
    "qwen3-moe expert count": (
        qwen3_moe_config,
        {**SHAPE, "model_type": "qwen3_moe", "num_experts": 8, "rope_theta": 1e4},
        {**SHAPE, "model_type": "qwen3_moe", "num_local_experts": 8,
         "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
    ),
}


def _read(tmp_path: Path, config: dict[str, Any]) -> Any:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return ModelConfig.read(tmp_path).raw


@pytest.mark.parametrize("name", list(TWINS))
def test_both_layouts_read_as_one_model(tmp_path: Path, name: str) -> None:
    reader, old, new = TWINS[name]
    assert reader(_read(tmp_path, new)) == reader(_read(tmp_path, old))


def test_the_file_wins_over_the_mapping() -> None:
    """A key the file has is kept; only absent ones are filled, and the input is not changed."""
    config = {"model_type": "llama", "rope_theta": 1.0, "rope_parameters": {"rope_theta": 2.0}}
    out = legacy_layout(config)
    assert out["rope_theta"] == 1.0 and out["rope_scaling"] is None
    assert "rope_scaling" not in config


@pytest.mark.parametrize(
    ("config", "scaled"),
    [
        ({"tie_word_embeddings": True}, True),  # T5 v1.0 by transformers 4
        ({"tie_word_embeddings": False}, False),  # v1.1, FLAN-T5, mT5 by transformers 4
        ({"tie_word_embeddings": True, "scale_decoder_outputs": False,
          "transformers_version": "5.17.0"}, False),  # v1.1 by transformers 5
        ({"tie_word_embeddings": True, "scale_decoder_outputs": True,
          "transformers_version": "5.17.0"}, True),  # v1.0 by transformers 5
        ({"model_type": "mt5", "tie_word_embeddings": True,
          "transformers_version": "5.17.0"}, False),  # transformers 5 never scales mT5
    ],
)
def test_t5_decoder_output_scale_by_writer(config: dict[str, Any], scaled: bool) -> None:
    raw = {"model_type": "t5", "d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2,
           "num_heads": 4, "decoder_start_token_id": 0, **config}  # fmt: skip
    assert T5Config.from_dict(raw).scale_decoder_outputs is scaled

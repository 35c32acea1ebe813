"""pytgi's own GPT-style models (GPT-2, GPT-BigCode, GPT-NeoX, Falcon, OPT, BLOOM, MPT) against
transformers on tiny random checkpoints built here from transformers' config classes, through the
paged cache (test_models.py's harness: a flat prefill across block boundaries, a mixed step, decode
steps), on one rank and on two (gloo), fp32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from pytgi_shard.device.distributed import Dist, init_distributed, single_process
from pytgi_shard.models import Model, ModelConfig, get_model
from tests.unit.shard.models.test_models import (
    CPU,
    _free_port,
    assert_matches,
    hf_logits,
    paged_logits,
    sequences,
)

VOCAB = 96

# Each family's tiny config: every option its decoder has that a served checkpoint uses.
CONFIGS: dict[str, dict[str, Any]] = {
    "gpt2": {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64,
             "n_inner": 48},
    "gpt2-scaled": {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4,
                    "n_positions": 64, "scale_attn_by_inverse_layer_idx": True,
                    "activation_function": "relu"},
    "gpt_bigcode": {"model_type": "gpt_bigcode", "n_embd": 32, "n_layer": 2, "n_head": 4,
                    "n_positions": 64, "multi_query": True},
    "gpt_bigcode-mha": {"model_type": "gpt_bigcode", "n_embd": 32, "n_layer": 2, "n_head": 4,
                        "n_positions": 64, "multi_query": False},
    "gpt_neox": {"model_type": "gpt_neox", "hidden_size": 32, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "intermediate_size": 48, "rotary_pct": 0.5,
                 "max_position_embeddings": 64, "use_parallel_residual": True},
    "gpt_neox-sequential": {"model_type": "gpt_neox", "hidden_size": 32, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "intermediate_size": 48, "rotary_pct": 1.0,
                            "max_position_embeddings": 64, "use_parallel_residual": False,
                            "attention_bias": False},
    # Falcon-7B style: multi-query, one shared norm before the parallel attention and MLP.
    "falcon-7b": {"model_type": "falcon", "hidden_size": 32, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "multi_query": True, "parallel_attn": True,
                  "max_position_embeddings": 64},
    # Falcon-40B style: grouped KV heads (2, one per rank), ln_attn and ln_mlp.
    "falcon-40b": {"model_type": "falcon", "hidden_size": 32, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_kv_heads": 2, "new_decoder_architecture": True,
                   "bias": True, "max_position_embeddings": 64},
    # Falcon 2 style: one KV head in the new architecture (replicated), one norm.
    "falcon-11b": {"model_type": "falcon", "hidden_size": 32, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_kv_heads": 1, "new_decoder_architecture": True,
                   "num_ln_in_parallel_attn": 1, "ffn_hidden_size": 40,
                   "max_position_embeddings": 64, "tie_word_embeddings": False},
    # Neither: per-head interleaved q/k/v, sequential residual.
    "falcon-mha": {"model_type": "falcon", "hidden_size": 32, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "multi_query": False, "parallel_attn": False,
                   "max_position_embeddings": 64},
    "opt": {"model_type": "opt", "hidden_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 4, "ffn_dim": 48, "max_position_embeddings": 64},
    # OPT-350m style: post-norm, embeddings narrower than the hidden states (project_in/out).
    "opt-350m": {"model_type": "opt", "hidden_size": 32, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "ffn_dim": 48, "max_position_embeddings": 64,
                 "do_layer_norm_before": False, "word_embed_proj_dim": 16},
    # Six heads: slopes beyond a power of two (three per rank).
    "bloom": {"model_type": "bloom", "hidden_size": 48, "n_layer": 2, "n_head": 6},
    "bloom-post-norm-residual": {"model_type": "bloom", "hidden_size": 32, "n_layer": 2,
                                 "n_head": 4, "apply_residual_connection_post_layernorm": True},
    # (transformers' MPT ignores alibi_bias_max and expansion_ratio: the defaults are held here)
    "mpt": {"model_type": "mpt", "d_model": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 64,
            "attn_config": {"clip_qkv": 0.6, "softmax_scale": 0.5}},
}


def load(path: Path, dist: Dist) -> Model:
    return get_model(ModelConfig.read(path), dtype=torch.float32, dist=dist)


def build(path: Path, spec: dict[str, Any], seed: int = 0) -> Path:
    """A random checkpoint of `spec` in Hugging Face layout (config.json, model.safetensors)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(spec)
    config = AutoConfig.for_model(spec.pop("model_type"), vocab_size=VOCAB, **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        # Large enough that attention is sharp (a wrong score scale changes the logits well
        # beyond the tolerance); norms keep their unit weights, biases get some noise.
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpt-models")
    return {name: build(root / name, spec) for name, spec in CONFIGS.items()}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(checkpoints: dict[str, Path], name: str) -> None:
    path = checkpoints[name]
    model = load(path, single_process(CPU))
    assert type(model).__module__.startswith("pytgi_shard.models.")
    assert "transformers" not in type(model).__module__
    seqs = sequences(model.vocab_size)
    assert_matches(paged_logits(model, seqs), hf_logits(path, seqs))


def _rank_main(rank: int, port: int, paths: list[Path], out_dir: Path) -> None:
    torch.set_num_threads(1)  # two ranks on a small CI machine: no oversubscription
    dist = init_distributed(rank, 2, "127.0.0.1", port, CPU)
    try:
        results = {path.name: paged_logits(load(path, dist), sequences(VOCAB)) for path in paths}
        torch.save(results, out_dir / f"rank{rank}.pt")
    finally:
        dist.close()


def test_two_ranks_match_transformers(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """world_size 2 over gloo: every rank returns transformers' logits (heads, MLP and vocabulary
    split; StarCoder's single KV head replicated)."""
    paths = list(checkpoints.values())
    mp.spawn(_rank_main, args=(_free_port(), paths, tmp_path), nprocs=2, join=True)
    for path in paths:
        seqs = sequences(VOCAB)
        expected = hf_logits(path, seqs)
        for rank in range(2):
            assert_matches(torch.load(tmp_path / f"rank{rank}.pt")[path.name], expected)


def test_learned_positions_bound_the_context(checkpoints: dict[str, Path]) -> None:
    rank1 = Dist(rank=1, world_size=2, device=CPU, group=None)
    model = load(checkpoints["gpt_bigcode"], rank1)
    assert model.learned_positions and model.max_position_embeddings == 64
    assert (model.num_kv_heads, model.head_dim) == (1, 8)

"""The Llama-style decoder's other families against transformers, on one rank and on two.

Each family's tiny model (tests/tiny_models.DECODER_FAMILIES and MOE_FAMILIES: transformers' own
config class, random weights, no download) runs through the paged cache as test_models.py runs Llama: prompts
across block boundaries and longer than any sliding window, a mixed step, decode steps; every
position's logits must equal transformers' full-sequence logits, on one rank and on each of two
ranks (one gloo spawn for all the families).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from pytgi_shard.device.distributed import init_distributed, single_process
from pytgi_shard.layers.rotary import RotaryEmbedding
from pytgi_shard.models import MODELS, ModelConfig, get_model
from pytgi_shard.models.llama.cohere import cohere_config
from pytgi_shard.models.llama.config import LlamaConfig
from pytgi_shard.models.llama.gemma import gemma2_config, gemma3_text_config, gemma_config
from pytgi_shard.models.llama.granite import granite_config
from pytgi_shard.models.llama.model import Llama
from pytgi_shard.models.llama.phi3 import phi3_config
from pytgi_shard.models.llama.starcoder2 import starcoder2_config
from tests.hf_config import compares_default, hf_fields
from tests.tiny_models import DECODER_FAMILIES, MOE_FAMILIES, VOCAB_SIZE
from tests.unit.shard.models.test_models import (
    CPU,
    _free_port,
    assert_matches,
    hf_logits,
    paged_logits,
    sequences,
)

SPECS = {**DECODER_FAMILIES, **MOE_FAMILIES}
FAMILIES = list(SPECS)


def test_every_family_is_registered() -> None:
    assert set(FAMILIES) <= set(MODELS)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_transformers(tiny_model: Callable[..., Path], family: str) -> None:
    path = tiny_model(family)
    model = get_model(ModelConfig.read(path), dtype=torch.float32, dist=single_process(CPU))
    assert isinstance(model, Llama) and model.model_type == family  # ours, not the fallback
    seqs = sequences(model.vocab_size)
    assert max(len(s) for s in seqs) > (SPECS[family].get("sliding_window") or 0)
    assert_matches(paged_logits(model, seqs), hf_logits(path, seqs))


def _rank_main(rank: int, port: int, paths: list[Path], out_dir: Path) -> None:
    torch.set_num_threads(1)  # two ranks on a small CI machine: no oversubscription
    dist = init_distributed(rank, 2, "127.0.0.1", port, CPU)
    try:
        results = {}
        for path in paths:
            model = get_model(ModelConfig.read(path), dtype=torch.float32, dist=dist)
            results[path.name] = paged_logits(model, sequences(model.vocab_size))
        torch.save(results, out_dir / f"rank{rank}.pt")
    finally:
        dist.close()


def test_families_on_two_ranks_match_transformers(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    """world_size 2 over gloo: heads, MLP, vocabulary and per-head norms split; every rank's
    logits equal transformers'."""
    paths = [tiny_model(family) for family in FAMILIES]
    mp.spawn(_rank_main, args=(_free_port(), paths, tmp_path), nprocs=2, join=True)
    per_rank = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for path in paths:
        expected = hf_logits(path, sequences(VOCAB_SIZE))
        for rank, results in enumerate(per_rank):
            try:
                assert_matches(results[path.name], expected)
            except AssertionError as e:
                raise AssertionError(f"{path.name} on rank {rank}: {e}") from e


# Our reading of a config.json with only model_type against transformers' config class defaults.
READERS = ["gemma", "gemma2", "gemma3_text", "qwen3", "phi3", "starcoder2", "granite", "cohere"]


@pytest.mark.parametrize("model_type", READERS)
def test_config_defaults_match_transformers(tmp_path: Path, model_type: str) -> None:
    from transformers import AutoConfig

    hf = AutoConfig.for_model(model_type)
    fields = hf_fields(hf)
    ours = _read_only(tmp_path, model_type)
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                 "rope_theta", "tie_word_embeddings"):
        if compares_default(model_type, name):
            assert getattr(ours, name) == fields[name], name
    assert ours.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    eps = next(getattr(hf, k) for k in ("rms_norm_eps", "norm_epsilon", "layer_norm_eps")
               if hasattr(hf, k))
    assert ours.rms_norm_eps == eps
    windows = [
        hf.sliding_window if kind == "sliding_attention" else None
        for kind in getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers
    ]
    if model_type in ("phi3", "starcoder2"):  # one window for every layer, None by default
        windows = [hf.sliding_window] * hf.num_hidden_layers
    assert list(ours.layer_windows) == windows


def _read_only(tmp_path: Path, model_type: str) -> LlamaConfig:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    raw = ModelConfig.read(tmp_path).raw
    return LlamaConfig.from_dict(raw) if model_type == "qwen3" else READER_OF[model_type](raw)


READER_OF = {
    "gemma": gemma_config, "gemma2": gemma2_config, "gemma3_text": gemma3_text_config,
    "phi3": phi3_config, "starcoder2": starcoder2_config, "granite": granite_config,
    "cohere": cohere_config,
}


def test_longrope_matches_transformers_short_and_long() -> None:
    """LongRoPE per position: the short factors within the pretraining context, the long ones
    from its end on, each as transformers computes them for a sequence of that length."""
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    short, long = [1.0, 1.1, 1.3, 2.0, 3.0, 4.0, 6.0, 8.0], [1.0, 2.0, 4.0, 8.0, 16.0, 24.0, 32.0, 48.0]
    hf = Phi3Config(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=512,
        original_max_position_embeddings=64,
        rope_scaling={"type": "longrope", "short_factor": short, "long_factor": long},
    )
    ours = phi3_config(hf_fields(hf))
    assert ours.rope_scaling is not None
    rotary = RotaryEmbedding(16, ours.rope_theta, 512, ours.rope_scaling, CPU)
    positions = torch.tensor([0, 5, 63, 64, 300])
    cos, sin = rotary.cos_sin(positions)
    init = ROPE_INIT_FUNCTIONS["longrope"]
    for i, p in enumerate(positions.tolist()):
        inv_freq, factor = init(hf, CPU, seq_len=p + 1)
        freqs = p * inv_freq
        torch.testing.assert_close(cos[i], freqs.cos() * factor)
        torch.testing.assert_close(sin[i], freqs.sin() * factor)
    assert rotary.attention_scaling > 1.0  # the context grew 8x: the attention factor applies


def test_gemma2_on_the_triton_kernels_matches_transformers(tiny_model: Callable[..., Path]) -> None:
    """Soft-capping and alternating windows reach the Triton kernels through the model (under
    the interpreter on CPU): the varlen kernel for prefill and mixed steps, split-K decode."""
    pytest.importorskip("triton")
    path = tiny_model("gemma2")
    model = get_model(
        ModelConfig.read(path), dtype=torch.float32, dist=single_process(CPU), attention="triton"
    )
    seqs = sequences(model.vocab_size)
    assert_matches(paged_logits(model, seqs), hf_logits(path, seqs))

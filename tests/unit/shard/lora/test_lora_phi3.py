"""LoRA on a second family: Phi-3, whose checkpoint fuses q/k/v into qkv_proj and gate/up into
gate_up_proj, and whose PEFT adapters adapt those fused modules (one A for all pieces, B's rows
the pieces' in order: shard/lora/attach.py splits B as the fused weight is split per rank). The
greedy tokens and logprobs under an adapter equal transformers on the model with W + scale·B·A
merged, on one rank and on two tensor-parallel ranks (gloo), in a batch mixing two adapters and
the base model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.service.startup import StartupRefused, load_engine
from pytgi_shard.settings import ShardSettings
from tests.hf_reference import hf_greedy
from tests.lora_adapters import PHI3_MODULES, merged_model, write_adapter
from tests.unit.shard.engine.test_batch import request
from tests.unit.shard.engine.test_engine import solo
from tests.unit.shard.lora.test_lora_two_ranks import (
    PROMPTS,
    _mixed_run,
    assert_like_one_rank,
    two_ranks,
)

NEW = 8


@pytest.fixture(scope="module")
def phi3_adapters(tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
                  ) -> dict[str, Path]:
    """alpha: every fused module, r=8; beta: qkv_proj and down_proj, r=4, rsLoRA."""
    root = tmp_path_factory.mktemp("lora_phi3")
    base = tiny_model("phi3")
    return {
        "alpha": write_adapter(root / "alpha", base, rank=8, alpha=16, seed=11,
                               modules=PHI3_MODULES),
        "beta": write_adapter(root / "beta", base, rank=4, alpha=8, rslora=True, seed=12,
                              modules=("qkv_proj", "down_proj")),
    }


def test_a_phi3_adapter_matches_transformers_on_the_merged_model(
    tiny_model: Callable[..., Path], phi3_adapters: dict[str, Path], tmp_path: Path
) -> None:
    base = tiny_model("phi3")
    spec = ",".join(f"{name}={path}" for name, path in phi3_adapters.items())
    engine = load_engine(ShardSettings(model_path=base, block_size=4, lora_adapters=spec))
    engine.warmup(pb.WarmupRequest(max_prefill_tokens=128, max_batch_total_tokens=2048))
    plain, _ = hf_greedy(base, PROMPTS[0], NEW, ignore_eos=True)
    for index, name in enumerate(phi3_adapters, start=1):
        merged = merged_model(tmp_path / name, base, phi3_adapters[name])
        expected, expected_lps = hf_greedy(merged, PROMPTS[0], NEW, ignore_eos=True)
        assert expected != plain, name  # the adapter changes the answer: the test can fail
        run = solo(engine, request(index, PROMPTS[0], max_new=NEW, ignore_eos=True,
                                   adapter_index=index))
        assert run.tokens[index] == expected, name
        torch.testing.assert_close(run.logprobs[index], expected_lps, rtol=1e-3, atol=1e-3)


def test_two_ranks_serve_a_mixed_phi3_batch_as_transformers(
    tiny_model: Callable[..., Path], phi3_adapters: dict[str, Path], tmp_path: Path
) -> None:
    """Both ranks give one rank's tokens and logprobs for the mix; the rows of adapter 1 (the
    second request of _mixed_run) give transformers' on the merged model."""
    model = tiny_model("phi3")
    spec = ",".join(f"{name}={path}" for name, path in phi3_adapters.items())
    ranks = two_ranks(_mixed_run, model, spec, tmp_path)
    assert_like_one_rank(ranks, _mixed_run(model, spec))
    merged = merged_model(tmp_path / "merged", model, phi3_adapters["alpha"])
    hf_tokens, hf_lps = hf_greedy(merged, PROMPTS[1], 6, ignore_eos=True)
    for tokens, logprobs in ranks:
        assert tokens[11] == hf_tokens
        torch.testing.assert_close(logprobs[11], hf_lps, rtol=1e-3, atol=1e-3)


def test_a_fused_module_and_its_pieces_in_one_layer_are_refused(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    base = tiny_model("phi3")
    both = write_adapter(tmp_path / "both", base, rank=4, alpha=8, modules=("qkv_proj",))
    extra = write_adapter(tmp_path / "extra", base, rank=4, alpha=8, modules=("q_proj",))
    from safetensors.torch import load_file, save_file

    tensors = {**load_file(str(both / "adapter_model.safetensors")),
               **load_file(str(extra / "adapter_model.safetensors"))}
    save_file(tensors, str(both / "adapter_model.safetensors"))
    with pytest.raises(StartupRefused, match="adapts qkv_proj and its pieces"):
        load_engine(ShardSettings(model_path=base, block_size=4, lora_adapters=f"both={both}"))

"""LoRA over quantized base weights (--quantize fp8 on the tiny Llama: every projection an FP8
QuantizedWeight): the update is independent of how the base weight is stored, so the greedy
tokens and logprobs under an adapter equal transformers on the model whose weights are the
engine's own dequantized ones with W + scale·B·A merged; the base model's rows stay the
dequantized model's."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.engine.engine import Engine
from pytgi_shard.lora.layer import LoraLinear
from pytgi_shard.models.llama.model import Llama
from pytgi_shard.quantization.linear_weight import QuantizedWeight
from pytgi_shard.service.startup import load_engine
from pytgi_shard.settings import ShardSettings
from tests.hf_reference import hf_greedy
from tests.lora_adapters import merged_model, write_adapter
from tests.unit.shard.engine.test_batch import batch_of, request
from tests.unit.shard.engine.test_engine import Run

PROMPT = [12, 40, 77, 9, 150, 33, 21]
NEW = 8


def _dequantized(linear: torch.nn.Module) -> torch.Tensor:
    base = linear.base if isinstance(linear, LoraLinear) else linear
    weight = base.weight
    assert isinstance(weight, QuantizedWeight), type(weight)
    return weight.dequantize().float()


def dequantized_checkpoint(engine: Engine, base: Path, out: Path) -> Path:
    """`base` with every projection replaced by the engine's dequantized weight (one rank)."""
    model = engine.model
    assert isinstance(model, Llama)
    shutil.copytree(base, out)
    weights = load_file(str(out / "model.safetensors"))
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        prefix = f"model.layers.{i}"
        q, k, v = _dequantized(attn.qkv).split([attn.q_size, attn.kv_size, attn.kv_size])
        gate, up = _dequantized(mlp.gate_up).chunk(2)
        for name, w in (("self_attn.q_proj", q), ("self_attn.k_proj", k),
                        ("self_attn.v_proj", v), ("self_attn.o_proj", _dequantized(attn.o_proj)),
                        ("mlp.gate_proj", gate), ("mlp.up_proj", up),
                        ("mlp.down_proj", _dequantized(mlp.down))):
            key = f"{prefix}.{name}.weight"
            assert weights[key].shape == w.shape, key
            weights[key] = w.to(weights[key].dtype).contiguous()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_an_adapter_over_fp8_weights_matches_the_dequantized_merged_model(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    base = tiny_model("llama")
    adapter = write_adapter(tmp_path / "alpha", base, rank=8, alpha=16, seed=21)
    engine = load_engine(ShardSettings(model_path=base, block_size=4, quantize="fp8",
                                       lora_adapters=f"alpha={adapter}"))
    engine.warmup(pb.WarmupRequest(max_prefill_tokens=128, max_batch_total_tokens=2048))
    dequantized = dequantized_checkpoint(engine, base, tmp_path / "dequantized")
    merged = merged_model(tmp_path / "merged", dequantized, adapter)
    expected, expected_lps = hf_greedy(merged, PROMPT, NEW, ignore_eos=True)
    plain, plain_lps = hf_greedy(dequantized, PROMPT, NEW, ignore_eos=True)
    assert expected != plain  # the adapter changes the answer: the test can fail
    reqs = [request(1, PROMPT, max_new=NEW, ignore_eos=True, adapter_index=1),
            request(2, PROMPT, max_new=NEW, ignore_eos=True, adapter_index=0)]
    run = Run(engine)
    run.finish(run.prefill(batch_of(*reqs, batch_id=1)))
    assert run.tokens[1] == expected
    torch.testing.assert_close(run.logprobs[1], expected_lps, rtol=1e-3, atol=1e-3)
    assert run.tokens[2] == plain
    torch.testing.assert_close(run.logprobs[2], plain_lps, rtol=1e-3, atol=1e-3)

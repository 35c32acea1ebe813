"""Issue 17: FP8 checkpoints (quant_method fp8 and compressed-tensors) written in the documented
layout load to exactly their dequantized weights, on 1 and 2 ranks: the payload read uncast,
per-tensor and per-channel scales, q/k/v fused with different per-tensor scales (kept as
per-row scales), row-parallel input slices; through get_model, on the FP8 kernel's class."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pytgi_shard.attention.backend import get_backend
from pytgi_shard.device.distributed import Dist, single_process
from pytgi_shard.layers.linear import ColumnParallelLinear, RowParallelLinear
from pytgi_shard.models import ModelConfig, get_model
from pytgi_shard.models.llama.config import LlamaConfig
from pytgi_shard.models.llama.model import Llama
from pytgi_shard.quantization.detection import detect_quantization
from pytgi_shard.quantization.errors import QuantizationError
from pytgi_shard.quantization.fp8_checkpoint import Fp8CheckpointLoader
from pytgi_shard.quantization.fp8_weight import Fp8Weight
from pytgi_shard.quantization.linear_format import DENSE, pre_quantized_format
from pytgi_shard.weights.reader import Weights
from tests.fp8_checkpoints import CONFIGS, write_fp8_checkpoint
from tests.unit.shard.models.test_models import paged_logits, sequences
from tests.unit.shard.quantized_double import DequantFp8

CPU = torch.device("cpu")
FORMAT = pre_quantized_format("fp8", Fp8CheckpointLoader(DequantFp8))


def rank(r: int, world: int) -> Dist:
    return Dist(rank=r, world_size=world, device=CPU, group=None)


@pytest.fixture(scope="module")
def fp8_models(
    tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("fp8")
    return {flavor: write_fp8_checkpoint(tiny_model("llama"), root, flavor) for flavor in CONFIGS}


def load(path: Path, dist: Dist, fp8: bool) -> Llama:
    raw = json.loads((path / "config.json").read_text())
    weights = Weights(path, torch.float32, dist, FORMAT if fp8 else DENSE)
    return Llama(LlamaConfig.from_dict(raw), weights, get_backend("reference"))


def linears(model: Llama) -> list[tuple[str, ColumnParallelLinear | RowParallelLinear]]:
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, ColumnParallelLinear | RowParallelLinear)]


@pytest.mark.parametrize("flavor", list(CONFIGS))
@pytest.mark.parametrize(("r", "world"), [(0, 1), (0, 2), (1, 2)])
def test_fp8_layers_are_the_dequantized_checkpoint(
    fp8_models: dict[str, tuple[Path, Path]], flavor: str, r: int, world: int
) -> None:
    fp8_dir, oracle_dir = fp8_models[flavor]
    spec = detect_quantization(fp8_dir, json.loads((fp8_dir / "config.json").read_text()))
    assert spec is not None and spec.method == "fp8" and spec.checkpoint_format == flavor
    quantized, oracle = load(fp8_dir, rank(r, world), True), load(oracle_dir, rank(r, world), False)
    pairs = list(zip(linears(quantized), linears(oracle), strict=True))
    assert len(pairs) == 2 * 4  # two layers: qkv, o, gate_up, down
    for (name, layer), (_, expected) in pairs:
        assert isinstance(layer.weight, DequantFp8), name
        assert layer.weight.fp8.dtype == torch.float8_e4m3fn
        assert torch.equal(layer.weight.dequantize(), expected.weight), name
    stored = load_file(fp8_dir / "model.safetensors")
    attn = quantized.layers[0].self_attn
    assert isinstance(attn.qkv.weight, DequantFp8) and isinstance(attn.o_proj.weight, DequantFp8)
    # q, k, v had their own per-tensor scales: one scale per output row now.
    assert attn.qkv.weight.scale.dim() == 1
    assert attn.o_proj.weight.scale.dim() == 0  # one per-tensor scale stays one
    prefix = "model.layers.0.self_attn"
    largest = max(stored[f"{prefix}.{p}_proj.input_scale"].item() for p in "qkv")
    assert attn.qkv.weight.input_scale is not None
    assert attn.qkv.weight.input_scale.item() == largest


def test_an_fp8_model_computes_as_its_dequantized_copy(
    fp8_models: dict[str, tuple[Path, Path]],
) -> None:
    fp8_dir, oracle_dir = fp8_models["compressed-tensors"]
    quantized = load(fp8_dir, rank(0, 1), True)
    oracle = load(oracle_dir, rank(0, 1), False)
    seqs = sequences(quantized.vocab_size)
    for got, expected in zip(paged_logits(quantized, seqs), paged_logits(oracle, seqs), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_malformed_fp8_tensors_are_refused(tmp_path: Path) -> None:
    fp8 = torch.randn(8, 4).to(torch.float8_e4m3fn)
    tensors = {
        "no_scale.weight": fp8.clone(),
        "block.weight": fp8.clone(), "block.weight_scale": torch.ones(2, 2),
        "mixed_a.weight": fp8.clone(), "mixed_a.weight_scale": torch.ones(1),
        "mixed_b.weight": torch.randn(8, 4),
    }  # fmt: skip
    save_file(tensors, tmp_path / "model.safetensors")
    weights = Weights(tmp_path, torch.float32, rank(0, 1), FORMAT)
    loader = weights.linear_loader
    with pytest.raises(QuantizationError, match="no_scale.weight has no no_scale.weight_scale"):
        loader.row(weights, "no_scale")
    with pytest.raises(QuantizationError, match=r"block.weight_scale has shape \[2, 2\]: .* not "
                       "block-wise"):
        loader.column(weights, ["block"], [(0, 1)])
    with pytest.raises(QuantizationError, match="mixed_a, mixed_b are fused into one matmul but "
                       "only some are stored in FP8"):
        loader.column(weights, ["mixed_a", "mixed_b"], [(0, 1), (0, 1)])
    # A projection stored in float (compressed-tensors' `ignore`) reads dense.
    assert torch.equal(loader.row(weights, "mixed_b"), tensors["mixed_b.weight"])


@pytest.mark.parametrize("flavor", list(CONFIGS))
def test_get_model_serves_an_fp8_checkpoint_on_the_fp8_kernel(
    fp8_models: dict[str, tuple[Path, Path]], flavor: str
) -> None:
    """Detected without a flag, read into the FP8 kernel's class (dequantize + F.linear on CPU):
    the dequantized copy's weights exactly, and its logits."""
    fp8_dir, oracle_dir = fp8_models[flavor]
    quantized = get_model(ModelConfig.read(fp8_dir), dtype=torch.float32, dist=single_process(CPU))
    oracle = get_model(ModelConfig.read(oracle_dir), dtype=torch.float32, dist=single_process(CPU))
    assert isinstance(quantized, Llama) and isinstance(oracle, Llama)
    for (name, layer), (_, expected) in zip(linears(quantized), linears(oracle), strict=True):
        assert isinstance(layer.weight, Fp8Weight), name
        assert torch.equal(layer.weight.dequantize(), expected.weight), name
    seqs = sequences(quantized.vocab_size)
    for got, want in zip(paged_logits(quantized, seqs), paged_logits(oracle, seqs), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)

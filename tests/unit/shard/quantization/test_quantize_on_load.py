"""Issue 17: --quantize on a float checkpoint reaches every column- and row-parallel linear of
pytgi's own families through get_model, whatever layout the family reads (projections by name,
stacked and grouped fused q|k|v, GPT-2's transposed Conv1D), into the class the kernel table
names for the method; the quantized weights approximate the float ones (each kernel's accuracy
is its own tests' business). lm_head and embeddings stay float."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from pytgi_shard.device.distributed import single_process
from pytgi_shard.layers.linear import ColumnParallelLinear, RowParallelLinear
from pytgi_shard.models import ModelConfig, get_model
from pytgi_shard.quantization.kernel_table import ON_LOAD
from pytgi_shard.quantization.linear_weight import QuantizedWeight
from pytgi_shard.quantization.resolution import resolve_quantization

CPU = torch.device("cpu")


def load(path: Path, quantize: str | None) -> nn.Module:
    config = ModelConfig.read(path)
    spec = resolve_quantization(path, config.raw, quantize)
    model = get_model(config, dtype=torch.float32, dist=single_process(CPU), quantization=spec)
    assert isinstance(model, nn.Module)
    return model


def linears(model: nn.Module) -> list[tuple[str, ColumnParallelLinear | RowParallelLinear]]:
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, ColumnParallelLinear | RowParallelLinear)]


@pytest.mark.parametrize("method", sorted(ON_LOAD))
def test_every_linear_of_a_llama_is_quantized(tiny_model: Callable[..., Path], method: str) -> None:
    path = tiny_model("llama")
    float_model, quantized = load(path, None), load(path, method)
    kind = type(ON_LOAD[method](torch.randn(16, 64)))
    pairs = list(zip(linears(quantized), linears(float_model), strict=True))
    assert len(pairs) == 8
    for (name, layer), (_, dense) in pairs:
        assert type(layer.weight) is kind, name
        assert isinstance(dense.weight, torch.Tensor)
        w = layer.weight.dequantize().float()
        error = (w - dense.weight).norm() / dense.weight.norm()
        assert error < 0.2, (name, float(error))  # 4-bit fp4 is the coarsest: ~0.1
    quantized_params = {n for n, m in quantized.named_modules() if isinstance(m, QuantizedWeight)}
    assert not any("embed" in n or "lm_head" in n for n in quantized_params)


@pytest.mark.parametrize(("family", "method"), [("gpt2", "eetq"), ("falcon", "fp8"),
                                                ("phi3", "bitsandbytes-nf4")])
def test_fused_and_conv1d_layouts_are_quantized_too(
    tiny_model: Callable[..., Path], family: str, method: str
) -> None:
    """GPT-2: Conv1D c_attn (stacked q|k|v, transposed) and MLP; Falcon: fused query_key_value;
    Phi-3: stacked qkv_proj and gate_up_proj."""
    model = load(tiny_model(family), method)
    layers = linears(model)
    assert layers and all(isinstance(m.weight, QuantizedWeight) for _, m in layers), [
        n for n, m in layers if not isinstance(m.weight, QuantizedWeight)]

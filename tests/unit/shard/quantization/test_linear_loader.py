"""The parallel linears read their weights through the checkpoint's LinearLoader: the dense one
gives each rank exactly the slices the layers read before loaders existed (each projection split
by output rows, K/V by head blocks, row-parallel by input columns, biases alike, bfloat16 cast),
on 1 and 2 ranks; a QuantizedWeight is held and multiplied by its own kernel; the fused-layout
readers hand their float weights to the format; FP8 tensors are never cast."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from pytgi_shard.device.distributed import Dist
from pytgi_shard.layers.conv1d import load_conv1d_column, load_conv1d_row
from pytgi_shard.layers.fused_qkv import HeadShape, load_stacked_qkv
from pytgi_shard.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    load_fused_column,
    load_qkv,
)
from pytgi_shard.quantization.errors import QuantizationError
from pytgi_shard.quantization.linear_format import DENSE, pre_quantized_format, quantized_on_load
from pytgi_shard.weights.reader import Weights
from tests.unit.shard.quantized_double import RowInt8

CPU = torch.device("cpu")
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 16, 4, 2, 4, 24


def rank(r: int, world: int) -> Dist:
    return Dist(rank=r, world_size=world, device=CPU, group=None)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    tensors = {
        "a.q_proj.weight": t(HEADS * HEAD_DIM, HIDDEN), "a.q_proj.bias": t(HEADS * HEAD_DIM),
        "a.k_proj.weight": t(KV_HEADS * HEAD_DIM, HIDDEN), "a.k_proj.bias": t(KV_HEADS * HEAD_DIM),
        "a.v_proj.weight": t(KV_HEADS * HEAD_DIM, HIDDEN), "a.v_proj.bias": t(KV_HEADS * HEAD_DIM),
        "a.o_proj.weight": t(HIDDEN, HEADS * HEAD_DIM), "a.o_proj.bias": t(HIDDEN),
        "m.gate_proj.weight": t(FFN, HIDDEN), "m.up_proj.weight": t(FFN, HIDDEN),
        "m.gate_up_proj.weight": t(2 * FFN, HIDDEN), "m.gate_up_proj.bias": t(2 * FFN),
        "m.down_proj.weight": t(HIDDEN, FFN),
        "s.qkv.weight": t((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
        "c.weight": t(HIDDEN, FFN), "c.bias": t(FFN),  # Conv1D: [in, out]
    }  # fmt: skip
    path = tmp_path_factory.mktemp("linears")
    save_file(tensors, path / "model.safetensors")
    return path, tensors


def part(t: torch.Tensor, index: int, parts: int, dim: int = 0) -> torch.Tensor:
    return t.chunk(parts, dim)[index]


@pytest.mark.parametrize(("r", "world"), [(0, 1), (0, 2), (1, 2)])
def test_dense_loader_reads_each_ranks_slices(
    checkpoint: tuple[Path, dict[str, torch.Tensor]], r: int, world: int
) -> None:
    path, full = checkpoint
    weights = Weights(path, torch.bfloat16, rank(r, world))
    kv = r if KV_HEADS % world == 0 else 0

    qkv = load_qkv(weights, "a", HEADS, KV_HEADS, bias=True)
    for suffix, got in (("weight", qkv.weight), ("bias", qkv.bias)):
        expected = torch.cat([
            part(full[f"a.q_proj.{suffix}"], r, world),
            part(full[f"a.k_proj.{suffix}"], kv, world),
            part(full[f"a.v_proj.{suffix}"], kv, world),
        ]).bfloat16()
        assert got is not None and got.dtype == torch.bfloat16
        assert torch.equal(got, expected)

    packed = ColumnParallelLinear.load_packed(weights, ["m.gate_proj", "m.up_proj"], bias=False)
    expected = torch.cat([part(full["m.gate_proj.weight"], r, world),
                          part(full["m.up_proj.weight"], r, world)])
    assert torch.equal(packed.weight, expected.bfloat16()) and packed.bias is None

    fused = load_fused_column(weights, "m.gate_up_proj", 2, bias=True)
    gate, up = full["m.gate_up_proj.weight"].chunk(2)
    assert torch.equal(fused.weight, torch.cat([part(gate, r, world), part(up, r, world)]).bfloat16())
    gate_b, up_b = full["m.gate_up_proj.bias"].chunk(2)
    assert fused.bias is not None
    assert torch.equal(fused.bias, torch.cat([part(gate_b, r, world), part(up_b, r, world)]).bfloat16())

    row = RowParallelLinear.load(weights, "a.o_proj", bias=True)
    assert torch.equal(row.weight, part(full["a.o_proj.weight"], r, world, dim=1).bfloat16())
    # The bias is added once, by rank 0.
    assert (row.bias is not None) == (r == 0)


def test_a_quantized_weight_is_held_and_runs_its_own_matmul() -> None:
    weight, bias = torch.randn(6, 8), torch.randn(6)
    quantized = RowInt8.from_float(weight)
    x = torch.randn(3, 8)
    column = ColumnParallelLinear(quantized, bias)
    assert column.weight is quantized  # a submodule: moves with .to(), listed by .modules()
    assert torch.equal(column(x), F.linear(x, quantized.dequantize()) + bias)
    row = RowParallelLinear(quantized, None, rank(0, 1))
    assert torch.equal(row(x), F.linear(x, quantized.dequantize()))
    dense = ColumnParallelLinear(weight, bias)
    assert isinstance(dense.weight, torch.nn.Parameter) and not dense.weight.requires_grad
    assert torch.equal(dense(x), F.linear(x, weight, bias))


@pytest.mark.parametrize(("r", "world"), [(0, 1), (1, 2)])
def test_on_load_quantizes_every_linear_read(
    checkpoint: tuple[Path, dict[str, torch.Tensor]], r: int, world: int
) -> None:
    """Projections by name and the models' own layouts (stacked q|k|v, Conv1D) alike."""
    path, _ = checkpoint
    dense = Weights(path, torch.float32, rank(r, world), DENSE)
    quant = Weights(path, torch.float32, rank(r, world), quantized_on_load("int8", RowInt8.from_float))
    heads = HeadShape(HEADS, KV_HEADS, HEAD_DIM)
    loads = [
        lambda w: load_qkv(w, "a", HEADS, KV_HEADS, bias=True),
        lambda w: ColumnParallelLinear.load_packed(w, ["m.gate_proj", "m.up_proj"], False),
        lambda w: load_fused_column(w, "m.gate_up_proj", 2, bias=True),
        lambda w: RowParallelLinear.load(w, "a.o_proj", bias=True),
        lambda w: load_stacked_qkv(w, "s.qkv", heads, bias=False),
        lambda w: load_conv1d_column(w, "c"),
        lambda w: load_conv1d_row(w, "c"),
    ]
    for load in loads:
        float_layer, quantized_layer = load(dense), load(quant)
        assert isinstance(quantized_layer.weight, RowInt8)
        assert torch.equal(quantized_layer.weight.dequantize(),
                           RowInt8.from_float(float_layer.weight).dequantize())
        if float_layer.bias is None:
            assert quantized_layer.bias is None
        else:
            assert quantized_layer.bias is not None
            assert torch.equal(quantized_layer.bias, float_layer.bias)


def test_a_pre_quantized_format_refuses_layers_read_as_float(
    checkpoint: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    path, _ = checkpoint
    weights = Weights(path, torch.float32, rank(0, 1), pre_quantized_format("gptq", DENSE.loader))
    with pytest.raises(QuantizationError, match="pytgi reads gptq weights only for projections"):
        load_stacked_qkv(weights, "s.qkv", HeadShape(HEADS, KV_HEADS, HEAD_DIM), bias=False)


def test_fp8_tensors_are_never_cast_and_scales_can_keep_their_dtype(tmp_path: Path) -> None:
    """Cast to the model's dtype, FP8 payloads would turn into wrong weights silently: they are
    read as stored, or refused where a float weight is expected."""
    fp8 = torch.randn(4, 8).to(torch.float8_e4m3fn)
    scale = torch.tensor([0.0123], dtype=torch.bfloat16)
    save_file({"w": fp8, "s": scale, "b": torch.randn(4)}, tmp_path / "model.safetensors")
    weights = Weights(tmp_path, torch.float16, rank(1, 2))
    got = weights.get_sharded("w", 0, cast=False)
    assert got.dtype == torch.float8_e4m3fn
    assert torch.equal(got.view(torch.uint8), fp8[2:].view(torch.uint8))
    assert weights.get_tensor("s").dtype == torch.float16
    assert weights.get_tensor("s", cast=False).dtype == torch.bfloat16
    assert weights.get_tensor("b").dtype == torch.float16
    assert weights.dtype_name("w") == "F8_E4M3"
    with pytest.raises(QuantizationError, match="'w' is stored in 8-bit floating point"):
        weights.get_sharded("w", 0)

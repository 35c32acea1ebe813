"""Adapters attached to a loaded Llama-family model: each adapted projection's linear layer
wrapped in a LoraLinear holding every adapter's (A, B) for it, fused as the layer is fused
(q|k|v in one matmul, gate|up in another), checked against the base model's shapes.

Tensor parallel: each rank keeps the slices that match its slice of the layer, as the weights
are read (shard/weights/reader.py: equal parts). A column-parallel layer (q|k|v, gate|up) holds
output part (index, count) of each projection: B's rows are sliced alike, A is whole. A
row-parallel layer (o, down) holds input part (rank, world): A's columns are sliced alike, B is
whole, and the update joins the partial sums before the all-reduce (layer.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pytgi_shard.device.distributed import Dist
from pytgi_shard.layers.linear import kv_head_partition
from pytgi_shard.layers.mlp import GatedMLP
from pytgi_shard.lora.layer import TORCH_PATH, TRITON_PATH, LoraLinear, RowAdapters
from pytgi_shard.lora.peft_adapter import AdapterRefused, PeftAdapter
from pytgi_shard.models.llama.model import Llama, LlamaDecoderLayer

# Each wrapped layer: (owner attribute, layer attribute, the projections fused in it, in order).
QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


def attach_adapters(model: object, adapters: Sequence[PeftAdapter], dist: Dist) -> RowAdapters:
    """Wraps the model's projections; returns the rows holder its ModelRunner binds per
    forward. Raises AdapterRefused (one line) for a model or adapter that does not fit."""
    rows = RowAdapters()
    if not adapters:
        return rows
    first = adapters[0].name
    if not isinstance(model, Llama):
        raise AdapterRefused(f"LoRA adapter {first!r}: {type(model).__name__} "
                             f"({getattr(model, 'model_type', '?')}) is not supported: LoRA "
                             "runs on pytgi's own Llama-family models only")
    mine = (dist.rank, dist.world_size)
    kv_part = kv_head_partition(model.config.num_key_value_heads, dist)
    # On CUDA with Triton the kernel pair reads the rows' slots on the device (layer.py).
    path = TRITON_PATH if dist.caps.triton_kernels else TORCH_PATH
    for adapter in adapters:
        layers = {layer for layer, _ in adapter.pairs}
        if max(layers) >= len(model.layers):
            raise AdapterRefused(f"LoRA adapter {adapter.name!r}: adapts layer {max(layers)}, "
                                 f"the model has {len(model.layers)}")
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, LlamaDecoderLayer)
        attn, mlp = layer.self_attn, layer.mlp
        kv = attn.kv_size
        plan: list[tuple[nn.Module, str, tuple[str, ...], Slicing]] = [
            (attn, "qkv", QKV, Slicing([attn.q_size, kv, kv], [mine, kv_part, kv_part])),
            (attn, "o_proj", ("o_proj",), Slicing(None, [mine], row=True))]
        if isinstance(mlp, GatedMLP):
            half = _dense(mlp.gate_up, adapters, i).shape[0] // 2
            # The fused activation kernel reads gate_up's output as before.
            plan += [(mlp, "gate_up", GATE_UP, Slicing([half, half], [mine, mine])),
                     (mlp, "down", ("down_proj",), Slicing(None, [mine], row=True))]
        elif any((i, m) in a.pairs for a in adapters for m in (*GATE_UP, "down_proj")):
            raise AdapterRefused(f"LoRA adapter {_naming(adapters, i, GATE_UP)!r}: layer {i}'s "
                                 "MLP is not a gate/up/down MLP (MoE or plain): not supported")
        for owner, attr, modules, slicing in plan:
            setattr(owner, attr,
                    _wrap(getattr(owner, attr), adapters, i, modules, slicing, rows, path))
    return rows


def _naming(adapters: Sequence[PeftAdapter], layer: int, modules: Sequence[str]) -> str:
    """The first adapter adapting one of `modules` at `layer` (the one a refusal names)."""
    return next(a.name for a in adapters if any((layer, m) in a.pairs for m in modules))


def _dense(linear: nn.Module, adapters: Sequence[PeftAdapter], layer: int) -> torch.Tensor:
    weight = getattr(linear, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise AdapterRefused(f"LoRA adapter {adapters[0].name!r}: layer {layer}'s weights are "
                             "quantized: LoRA runs on float weights only")
    return weight


@dataclass(frozen=True, slots=True)
class Slicing:
    """How a layer's rank-local weight relates to the checkpoint's projections: the local output
    size of each fused piece (None: one piece, the whole output) and the part this rank holds of
    each piece's output (column-parallel) or of the input (row-parallel, one piece)."""

    sizes: list[int] | None
    parts: list[tuple[int, int]]
    row: bool = False


def _wrap(linear: nn.Module, adapters: Sequence[PeftAdapter], layer: int,
          modules: Sequence[str], slicing: Slicing, rows: RowAdapters,
          path: str = TORCH_PATH) -> nn.Module:
    """`linear` in a LoraLinear when any adapter adapts one of `modules` at `layer`, adapter
    i's fused (A, B) written into slot i + 1 (its wire index) through LoraLinear.set_slot."""
    if not any((layer, m) in a.pairs for a in adapters for m in modules):
        return linear
    weight = _dense(linear, adapters, layer)
    out_features = weight.shape[0]
    sizes = slicing.sizes or [out_features]
    if sum(sizes) != out_features:
        raise AdapterRefused(f"LoRA adapter {adapters[0].name!r}: layer {layer} "
                             f"{'/'.join(modules)} do not fuse as {sizes} ({out_features})")
    a_list, b_list = [], []
    for adapter in adapters:
        a, b = _fused_pair(adapter, layer, modules, dataclasses.replace(slicing, sizes=sizes),
                           weight)
        a_list.append(a)
        b_list.append(b)
    lora = LoraLinear(linear, rows, in_features=weight.shape[1], out_features=out_features,
                      slots=len(adapters) + 1, max_rank=max(1, *(a.shape[0] for a in a_list)),
                      dtype=weight.dtype, device=weight.device, path=path)
    for i, (a, b) in enumerate(zip(a_list, b_list, strict=True)):
        if a.shape[0]:
            lora.set_slot(i + 1, a, b)
    return lora


def _fused_pair(adapter: PeftAdapter, layer: int, modules: Sequence[str], slicing: Slicing,
                weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A stacked over the adapted pieces, B block-diagonal in the fused output rows (empty
    when the adapter adapts none of them here), each sliced to this rank's part."""
    sizes = slicing.sizes or []
    in_features = weight.shape[1]
    pieces = [(m, start, size, part) for m, start, size, part in
              zip(modules, _starts(sizes), sizes, slicing.parts, strict=True)
              if (layer, m) in adapter.pairs]
    total = sum(adapter.pairs[(layer, m)][0].shape[0] for m, _, _, _ in pieces)
    a = weight.new_zeros(total, in_features)
    b = weight.new_zeros(sum(sizes), total)
    col = 0
    for module, start, size, (index, count) in pieces:
        pa, pb = adapter.pairs[(layer, module)]
        full_out, full_in = (size, in_features * count) if slicing.row else (
            size * count, in_features)
        if pa.shape[1] != full_in or pb.shape[0] != full_out:
            raise AdapterRefused(
                f"LoRA adapter {adapter.name!r}: layer {layer} {module} is {pb.shape[0]}×"
                f"{pa.shape[1]}, the base model's is {full_out}×{full_in}")
        if slicing.row:
            pa = pa[:, index * in_features:(index + 1) * in_features]
        else:
            pb = pb[index * size:(index + 1) * size]
        r = pa.shape[0]
        a[col:col + r] = pa.to(weight.device, weight.dtype)
        b[start:start + size, col:col + r] = pb.to(weight.device, weight.dtype)
        col += r
    return a, b


def _starts(sizes: list[int]) -> list[int]:
    out, at = [], 0
    for size in sizes:
        out.append(at)
        at += size
    return out

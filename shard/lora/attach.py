"""Adapters attached to a loaded Llama-family model: each adapted projection's linear layer
wrapped in a LoraLinear holding every adapter's (A, B) for it, fused as the layer is fused
(q|k|v in one matmul, gate|up in another), checked against the base model's shapes.

Tensor parallel: each rank keeps the slices that match its slice of the layer, as the weights
are read (shard/weights/reader.py: equal parts). A column-parallel layer (q|k|v, gate|up) holds
output part (index, count) of each projection: B's rows are sliced alike, A is whole. A
row-parallel layer (o, down) holds input part (rank, world): A's columns are sliced alike, B is
whole, and the update joins the partial sums before the all-reduce (layer.py).

Two steps, so that adapters can come and go while the model serves: `attach_sites` wraps the
layers once, at start-up (every supported projection when adapters may be loaded live, else those
the start-up adapters adapt), each LoraLinear with `slots` device slots of `max_rank` per fused
piece; `fuse` turns one adapter into its (A, B) per site, on the host, checked against the
layers (the same checks at start-up and for a live load). Writing them into a device slot is
shard/lora/residency.py's business."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from pytgi_shard.device.distributed import Dist
from pytgi_shard.layers.linear import kv_head_partition
from pytgi_shard.layers.mlp import GatedMLP
from pytgi_shard.lora import cpu_kernel
from pytgi_shard.lora.layer import (
    CPU_KERNEL_PATH,
    TORCH_PATH,
    TRITON_PATH,
    LoraLinear,
    RowAdapters,
)
from pytgi_shard.lora.peft_adapter import AdapterRefused, PeftAdapter
from pytgi_shard.models.llama.model import Llama, LlamaDecoderLayer
from pytgi_shard.quantization.linear_weight import QuantizedWeight

# Each wrapped layer: (owner attribute, layer attribute, the projections fused in it, in order).
QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")
# Checkpoints that fuse the projections themselves (Phi-3: qkv_proj, gate_up_proj) have adapters
# of the fused module: one A for all pieces, B's rows the pieces' rows in order.
FUSED = {"qkv_proj": QKV, "gate_up_proj": GATE_UP}


def adapts(adapter: PeftAdapter, layer: int, modules: Sequence[str]) -> bool:
    """Whether `adapter` adapts one of `modules` at `layer`, piece by piece or fused."""
    return any((layer, m) in adapter.pairs for m in (*modules, *_fused_names(modules)))


def _fused_names(modules: Sequence[str]) -> list[str]:
    return [name for name, pieces in FUSED.items() if tuple(modules) == pieces]


@dataclass(frozen=True, slots=True)
class Site:
    """One wrapped linear layer: its decoder layer, the checkpoint projections fused in it (in
    order), how this rank's weight slices them, and the LoraLinear holding the slots."""

    layer: int
    modules: tuple[str, ...]
    slicing: Slicing
    lora: LoraLinear
    # The layer's rank-local weight: (out, in) and dtype, what an adapter's pairs are built to.
    out_features: int
    in_features: int
    dtype: torch.dtype


@dataclass(slots=True)
class Sites:
    """Every wrapped layer of one model, and what a later adapter is checked against."""

    rows: RowAdapters = field(default_factory=RowAdapters)
    sites: list[Site] = field(default_factory=list)
    num_layers: int = 0
    # Layers whose MLP is not gate/up/down (MoE, plain): an adapter of gate/up/down there is refused.
    plain_mlp: frozenset[int] = frozenset()

    def slot_bytes(self) -> int:
        """Device bytes of one slot over every wrapped layer (A and Bᵀ at full capacity): what
        each of --max-loras costs beside the KV cache."""
        return sum(s.lora.max_rank * (s.in_features + s.out_features)
                   * torch.empty((), dtype=s.dtype).element_size() for s in self.sites)


def lora_path(dist: Dist, device: torch.device) -> str:
    """How the wrapped layers compute the update: on CUDA with Triton the kernel pair reads the
    rows' slots on the device (layer.py); on the CPU the fused C++ kernel, built here, at
    start-up, unless --disable-custom-kernels or it cannot be built (one warning line); else
    torch ops."""
    if dist.caps.triton_kernels:
        return TRITON_PATH
    if torch.device(device).type == "cpu" and dist.caps.custom_kernels and cpu_kernel.load():
        return CPU_KERNEL_PATH
    return TORCH_PATH


def attach_sites(model: object, dist: Dist, adapters: Sequence[PeftAdapter], *, every: bool,
                 slots: int, max_rank: int) -> Sites:
    """Wraps the model's projections in LoraLinear layers of `slots` device slots (slot 0: the
    base model) and `max_rank` rank per fused piece: all of them when `every` (live loading),
    else those some adapter of `adapters` adapts. Raises AdapterRefused (one line) for a model
    that cannot take adapters."""
    who = f"LoRA adapter {adapters[0].name!r}" if adapters else "LoRA runtime updates"
    if not isinstance(model, Llama):
        raise AdapterRefused(f"{who}: {type(model).__name__} "
                             f"({getattr(model, 'model_type', '?')}) is not supported: LoRA "
                             "runs on pytgi's own Llama-family models only")
    mine = (dist.rank, dist.world_size)
    kv_part = kv_head_partition(model.config.num_key_value_heads, dist)
    path = lora_path(dist, model.device)
    out = Sites(num_layers=len(model.layers))
    plain = set()
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, LlamaDecoderLayer)
        attn, mlp = layer.self_attn, layer.mlp
        kv = attn.kv_size
        plan: list[tuple[nn.Module, str, tuple[str, ...], Slicing]] = [
            (attn, "qkv", QKV, Slicing([attn.q_size, kv, kv], [mine, kv_part, kv_part])),
            (attn, "o_proj", ("o_proj",), Slicing(None, [mine], row=True))]
        if isinstance(mlp, GatedMLP):
            half = _shape(mlp.gate_up, model, who, i).out_features // 2
            # The fused activation kernel reads gate_up's output as before.
            plan += [(mlp, "gate_up", GATE_UP, Slicing([half, half], [mine, mine])),
                     (mlp, "down", ("down_proj",), Slicing(None, [mine], row=True))]
        else:
            plain.add(i)
        for owner, attr, modules, slicing in plan:
            if not every and not any(adapts(a, i, modules) for a in adapters):
                continue
            linear = getattr(owner, attr)
            weight = _shape(linear, model, who, i)
            sizes = slicing.sizes or [weight.out_features]
            if sum(sizes) != weight.out_features:
                raise AdapterRefused(f"{who}: layer {i} {'/'.join(modules)} do not fuse as "
                                     f"{sizes} ({weight.out_features})")
            lora = LoraLinear(linear, out.rows, in_features=weight.in_features,
                              out_features=weight.out_features, slots=slots,
                              max_rank=max_rank * len(modules), dtype=weight.dtype,
                              device=model.device, path=path, pieces=sizes)
            setattr(owner, attr, lora)
            out.sites.append(Site(i, modules, dataclasses.replace(slicing, sizes=sizes), lora,
                                  weight.out_features, weight.in_features, weight.dtype))
    out.plain_mlp = frozenset(plain)
    return out


def fuse(adapter: PeftAdapter, sites: Sites) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """The adapter's (A, B) for each site (None where it adapts none of the site's pieces), on
    the host in the sites' dtype, sliced to this rank's part; AdapterRefused (one line) for an
    adapter that does not fit the model's layers."""
    layers = {layer for layer, _ in adapter.pairs}
    if max(layers) >= sites.num_layers:
        raise AdapterRefused(f"LoRA adapter {adapter.name!r}: adapts layer {max(layers)}, "
                             f"the model has {sites.num_layers}")
    for layer, module in adapter.pairs:
        if layer in sites.plain_mlp and module in (*GATE_UP, "gate_up_proj", "down_proj"):
            raise AdapterRefused(f"LoRA adapter {adapter.name!r}: layer {layer}'s MLP is not a "
                                 "gate/up/down MLP (MoE or plain): not supported")
    covered = {(s.layer, m) for s in sites.sites for m in (*s.modules, *_fused_names(s.modules))}
    missing = sorted(set(adapter.pairs) - covered)
    if missing:  # only without runtime updates, where every start-up adapter was planned for
        raise AdapterRefused(f"LoRA adapter {adapter.name!r}: layer {missing[0][0]} "
                             f"{missing[0][1]} is not adapted in this server")
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for site in sites.sites:
        if not adapts(adapter, site.layer, site.modules):
            out.append(None)
            continue
        pair = _fused_pair(adapter, site)
        if pair[0].shape[0] > site.lora.max_rank:
            raise AdapterRefused(f"LoRA adapter {adapter.name!r}: layer {site.layer} "
                                 f"{'/'.join(site.modules)} has rank {pair[0].shape[0]}, above "
                                 f"the {site.lora.max_rank} this server holds (--max-lora-rank)")
        out.append(pair)
    return out


@dataclass(frozen=True, slots=True)
class _Shape:
    """What a LoRA slot is built to: the layer's rank-local (out, in) and the dtype the update
    computes in (the activations')."""

    out_features: int
    in_features: int
    dtype: torch.dtype


def _shape(linear: nn.Module, model: Llama, who: str, layer: int) -> _Shape:
    """The layer's shape from its float weight, or from its quantized weight (--quantize, a
    quantized checkpoint: the update is independent of how the base weight is stored; it runs
    in the model's dtype beside the quantized matmul)."""
    weight = getattr(linear, "weight", None)
    if isinstance(weight, torch.Tensor):
        return _Shape(weight.shape[0], weight.shape[1], weight.dtype)
    if isinstance(weight, QuantizedWeight):
        return _Shape(weight.out_features, weight.in_features, model.dtype)
    raise AdapterRefused(f"{who}: layer {layer}'s {type(linear).__name__} has no weight a LoRA "
                         "update can be shaped by")


@dataclass(frozen=True, slots=True)
class Slicing:
    """How a layer's rank-local weight relates to the checkpoint's projections: the local output
    size of each fused piece (None: one piece, the whole output) and the part this rank holds of
    each piece's output (column-parallel) or of the input (row-parallel, one piece)."""

    sizes: list[int] | None
    parts: list[tuple[int, int]]
    row: bool = False


def _fused_pair(adapter: PeftAdapter, site: Site) -> tuple[torch.Tensor, torch.Tensor]:
    """A stacked over the pieces, B block-diagonal in the fused output rows, each sliced to this
    rank's part; piece p at rank rows/columns [p·r, (p+1)·r), zeros for a piece the adapter
    does not adapt (LoraLinear.set_slot's layout); on the host (the copy kept while evicted from
    the device)."""
    layer, modules, slicing = site.layer, site.modules, site.slicing
    sizes = slicing.sizes or []
    in_features, dtype = site.in_features, site.dtype
    fused = [name for name in _fused_names(modules) if (layer, name) in adapter.pairs]
    if fused:
        return _checkpoint_fused_pair(adapter, site, fused[0])
    pieces = [(p, m, start, size, part) for p, (m, start, size, part) in
              enumerate(zip(modules, _starts(sizes), sizes, slicing.parts, strict=True))
              if (layer, m) in adapter.pairs]
    r = adapter.rank
    a = torch.zeros(r * len(modules), in_features, dtype=dtype)
    b = torch.zeros(sum(sizes), r * len(modules), dtype=dtype)
    for p, module, start, size, (index, count) in pieces:
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
        col = p * r
        a[col:col + r] = pa.to(dtype)
        b[start:start + size, col:col + r] = pb.to(dtype)
    return a, b


def _checkpoint_fused_pair(adapter: PeftAdapter, site: Site, name: str
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """An adapter of a checkpoint-fused module (Phi-3's qkv_proj, gate_up_proj): its one A
    serves every piece (repeated per piece in the pieces' layout); B's rows are the pieces' full
    outputs in order, each sliced to this rank's part of that piece (as the fused weight itself
    is sliced when loaded) and placed in the piece's own columns."""
    layer, slicing = site.layer, site.slicing
    sizes = slicing.sizes or []
    if any((layer, m) in adapter.pairs for m in site.modules):
        raise AdapterRefused(f"LoRA adapter {adapter.name!r}: layer {layer} adapts {name} and "
                             f"its pieces {'/'.join(site.modules)} both")
    pa, pb = adapter.pairs[(layer, name)]
    full = [size * count for size, (_, count) in zip(sizes, slicing.parts, strict=True)]
    if pa.shape[1] != site.in_features or pb.shape[0] != sum(full):
        raise AdapterRefused(f"LoRA adapter {adapter.name!r}: layer {layer} {name} is "
                             f"{pb.shape[0]}×{pa.shape[1]}, the base model's is "
                             f"{sum(full)}×{site.in_features}")
    r = pa.shape[0]
    b = torch.zeros(sum(sizes), r * len(sizes), dtype=site.dtype)
    for p, (start, size, (index, _), piece) in enumerate(zip(
            _starts(sizes), sizes, slicing.parts, pb.split(full), strict=True)):
        b[start:start + size, p * r:(p + 1) * r] = piece[index * size:(index + 1) * size].to(
            site.dtype)
    return pa.to(site.dtype).repeat(len(sizes), 1), b


def _starts(sizes: list[int]) -> list[int]:
    out, at = [], 0
    for size in sizes:
        out.append(at)
        at += size
    return out

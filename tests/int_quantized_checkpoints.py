"""GPTQ and AWQ layers written from known integers in the formats' documented layouts, for the
loader tests. The packers here are bit loops written from the layouts alone (no shared code with
pytgi_shard.quantization), so a loader that reads them back exactly reads the real format:

GPTQ (AutoGPTQ's QuantLinear.pack, TGI layers/gptq): qweight int32 [in / pack, out], input
pack*r + j at bits j*bits of word [r, o]; qzeros int32 [groups, out / pack], column pack*c + j at
bits j*bits of word [g, c], stored minus one in format v1 ("gptq"), as is in v2 ("gptq_v2");
scales float16 [groups, out]; g_idx int32 [in].
AWQ GEMM (AutoAWQ's WQLinear_GEMM.from_linear): qweight int32 [in, out / 8] and qzeros int32
[groups, out / 8], output 8c + ORDER[j] at bits 4j of word c, ORDER = 0, 2, 4, 6, 1, 3, 5, 7;
scales float16 [groups, out]; groups of group_size consecutive inputs.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


@dataclass(frozen=True)
class IntLayer:
    """W[o, i] = scales[g_idx[i], o] * (q[i, o] - zeros[g_idx[i], o])."""

    q: torch.Tensor  # int64 [in, out]
    zeros: torch.Tensor  # int64 [groups, out]
    scales: torch.Tensor  # float16 [groups, out]
    g_idx: torch.Tensor  # int32 [in]
    bits: int

    def dequantized(self) -> torch.Tensor:
        """[out, in] float32, in float64 first (every value exact) — the oracle."""
        g = self.g_idx.long()
        w = self.scales.double()[g] * (self.q - self.zeros[g]).double()
        return w.t().float().contiguous()


def random_layer(
    in_features: int, out_features: int, bits: int, group_size: int, act_order: bool,
    sym: bool, seed: int, zero_min: int = 0,
) -> IntLayer:  # fmt: skip
    """Random integers, float16 scales, zeros 2**(bits-1) when symmetric; act-order: g_idx a
    random permutation of arange // group_size, as GPTQ's desc_act writes it."""
    g = torch.Generator().manual_seed(seed)
    groups = -(-in_features // group_size)
    top = 1 << bits
    q = torch.randint(0, top, (in_features, out_features), generator=g)
    if sym:
        zeros = torch.full((groups, out_features), top // 2, dtype=torch.int64)
    else:
        zeros = torch.randint(zero_min, top, (groups, out_features), generator=g)
    scales = (torch.rand(groups, out_features, generator=g) * 0.02 + 0.001).half()
    g_idx = torch.arange(in_features, dtype=torch.int32) // group_size
    if act_order:
        g_idx = g_idx[torch.randperm(in_features, generator=g)]
    return IntLayer(q, zeros, scales, g_idx, bits)


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words below 2**32 -> the int32 with the same bits."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[rows, cols] -> int32 [rows / pack, cols], row pack*r + j in bits j*bits of [r, c]."""
    pack = 32 // bits
    values = values.to(torch.int64)
    assert int(values.min()) >= 0 and int(values.max()) < 1 << bits
    words = torch.zeros(values.shape[0] // pack, values.shape[1], dtype=torch.int64)
    for r in range(words.shape[0]):
        for j in range(pack):
            words[r] |= values[r * pack + j] << (j * bits)
    return _as_int32(words)


def pack_cols(values: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """[rows, cols] -> int32 [rows, cols / pack], column pack*c + order[j] in bits j*bits."""
    pack = 32 // bits
    order = order or list(range(pack))
    values = values.to(torch.int64)
    assert int(values.min()) >= 0 and int(values.max()) < 1 << bits
    words = torch.zeros(values.shape[0], values.shape[1] // pack, dtype=torch.int64)
    for c in range(words.shape[1]):
        for j in range(pack):
            words[:, c] |= values[:, c * pack + order[j]] << (j * bits)
    return _as_int32(words)


def gptq_tensors(
    layer: IntLayer, prefix: str, checkpoint_format: str, with_g_idx: bool = True
) -> dict[str, torch.Tensor]:
    """A GPTQ linear as AutoGPTQ (v1, "gptq") or GPTQModel (v2, "gptq_v2") stores it."""
    stored_zeros = layer.zeros - 1 if checkpoint_format == "gptq" else layer.zeros
    tensors = {
        f"{prefix}.qweight": pack_rows(layer.q, layer.bits),
        f"{prefix}.qzeros": pack_cols(stored_zeros, layer.bits),
        f"{prefix}.scales": layer.scales,
    }
    if with_g_idx:
        tensors[f"{prefix}.g_idx"] = layer.g_idx.clone()
    return tensors


def awq_tensors(layer: IntLayer, prefix: str) -> dict[str, torch.Tensor]:
    """An AWQ GEMM linear as AutoAWQ stores it (groups must be consecutive)."""
    return {
        f"{prefix}.qweight": pack_cols(layer.q, 4, AWQ_ORDER),
        f"{prefix}.qzeros": pack_cols(layer.zeros, 4, AWQ_ORDER),
        f"{prefix}.scales": layer.scales,
    }


def quantize_float(weight: torch.Tensor, bits: int, group_size: int, act_order: bool,
                   sym: bool, zero_min: int, seed: int) -> IntLayer:  # fmt: skip
    """A float [out, in] weight quantized per group of inputs, min-max (asymmetric) or around
    the midpoint (symmetric), float16 scales; act-order groups a random permutation's runs."""
    w = weight.detach().double().t()  # [in, out]
    in_features = w.shape[0]
    g_idx = torch.arange(in_features, dtype=torch.int32) // group_size
    if act_order:
        g_idx = g_idx[torch.randperm(in_features, generator=torch.Generator().manual_seed(seed))]
    top = (1 << bits) - 1
    groups = int(g_idx.max()) + 1
    scales = torch.empty(groups, w.shape[1], dtype=torch.float16)
    zeros = torch.empty(groups, w.shape[1], dtype=torch.int64)
    q = torch.empty_like(w, dtype=torch.int64)
    for g in range(groups):
        rows = g_idx == g
        lo, hi = w[rows].amin(0).clamp(max=0), w[rows].amax(0).clamp(min=0)
        if sym:
            half = torch.maximum(-lo, hi)
            lo, hi = -half, half
        scale = ((hi - lo) / top).clamp(min=1e-6).half()
        zero = torch.full_like(lo, (top + 1) // 2, dtype=torch.int64) if sym else \
            (-lo / scale.double()).round().long().clamp(zero_min, top)  # fmt: skip
        scales[g], zeros[g] = scale, zero
        q[rows] = (w[rows] / scale.double() + zero).round().long().clamp(0, top)
    return IntLayer(q, zeros, scales, g_idx, bits)


LLAMA_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip


# Which input each projection reads (a layer's q, k and v read the same one; gate and up too).
INPUT_OF = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "gate_proj": 2, "up_proj": 2,
            "down_proj": 3}  # fmt: skip


def write_quantized_llama(source: Path, quantized: Path, dequantized: Path, method: str,
                          fmt: str, act_order: bool, sym: bool, group_size: int) -> None:  # fmt: skip
    """From a float Llama checkpoint: its GPTQ (`fmt` "gptq"/"gptq_v2") or AWQ ("gemm") export
    with a quantization_config, and the float copy of exactly what that export dequantizes to
    (the same config without it), the oracle transformers runs."""
    tensors = load_file(str(source / "model.safetensors"))
    packed: dict[str, torch.Tensor] = {}
    floats = dict(tensors)
    for name in sorted(tensors):
        prefix = name.removesuffix(".weight")
        if not name.endswith(".weight") or not prefix.endswith(LLAMA_LINEARS):
            packed[name] = tensors[name]
            continue
        zero_min = 1 if fmt == "gptq" else 0  # v1 stores zero - 1
        # Act-order follows the input's statistics: projections of one input (q, k and v;
        # gate and up) get the same permutation, as GPTQ computes it from the same Hessian.
        layer_index = int(prefix.split(".layers.")[1].split(".")[0])
        seed = 10 * layer_index + INPUT_OF[prefix.rsplit(".", 1)[1]]
        layer = quantize_float(tensors[name], 4, group_size, act_order, sym, zero_min, seed)
        floats[name] = layer.dequantized()
        packed |= awq_tensors(layer, prefix) if method == "awq" else \
            gptq_tensors(layer, prefix, fmt)  # fmt: skip
    config = json.loads((source / "config.json").read_text())
    if method == "awq":
        quantization = {"quant_method": "awq", "bits": 4, "group_size": group_size,
                        "zero_point": True, "version": fmt}  # fmt: skip
    else:
        quantization = {"quant_method": "gptq", "bits": 4, "group_size": group_size,
                        "desc_act": act_order, "sym": sym, "checkpoint_format": fmt}  # fmt: skip
    for dest, weights, extra in [(quantized, packed, {"quantization_config": quantization}),
                                 (dequantized, floats, {})]:  # fmt: skip
        shutil.copytree(source, dest)
        save_file(weights, str(dest / "model.safetensors"))
        (dest / "config.json").write_text(json.dumps(config | extra))

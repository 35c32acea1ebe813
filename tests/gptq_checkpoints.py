"""A whole tiny model as a GPTQ checkpoint, for start-up and serving tests: each decoder
projection round-to-nearest quantized to 4 bits in groups (asymmetric, optionally act-order),
stored by tests/int_quantized_checkpoints.py's packers in AutoGPTQ's v1 layout, everything else
float; beside it the float checkpoint of the dequantized weights, the oracle.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.int_quantized_checkpoints import IntLayer, gptq_tensors

PROJECTION = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")


def rtn_layer(weight: torch.Tensor, bits: int, group_size: int, act_order: bool,
              seed: int) -> IntLayer:
    """W [out, in] as q, zeros (1..2**bits - 1, so that v1's zero - 1 packs) and float16 scales
    per group of inputs; act-order: the groups of a random permutation of the inputs."""
    in_features = weight.shape[1]
    g_idx = torch.arange(in_features, dtype=torch.int32) // group_size
    if act_order:
        g_idx = g_idx[torch.randperm(in_features, generator=torch.Generator().manual_seed(seed))]
    w = weight.double().t()  # [in, out]
    groups, top = in_features // group_size, (1 << bits) - 1
    scales = torch.empty(groups, w.shape[1], dtype=torch.float16)
    zeros = torch.empty(groups, w.shape[1], dtype=torch.int64)
    for g in range(groups):
        rows = w[g_idx == g]
        lo, hi = rows.min(0).values.clamp(max=0), rows.max(0).values.clamp(min=0)
        scales[g] = ((hi - lo) / top).clamp(min=1e-4).half()
        zeros[g] = torch.round(-lo / scales[g].double()).clamp(1, top).long()
    q = torch.round(w / scales.double()[g_idx.long()]) + zeros[g_idx.long()]
    return IntLayer(q.clamp(0, top).long(), zeros, scales, g_idx, bits)


def write_gptq_checkpoint(float_model: Path, dest: Path, group_size: int = 32,
                          act_order: bool = True) -> tuple[Path, Path]:
    """(the GPTQ checkpoint, the float checkpoint of its dequantized weights)."""
    gptq_dir, oracle_dir = dest / "gptq", dest / "gptq-dequantized"
    for d in (gptq_dir, oracle_dir):
        shutil.copytree(float_model, d, ignore=shutil.ignore_patterns("*.safetensors*"))
    tensors = {}
    for file in sorted(float_model.glob("*.safetensors")):
        tensors.update(load_file(file))
    stored, oracle = {}, {}
    for name, tensor in sorted(tensors.items()):
        if not PROJECTION.search(name):
            stored[name] = oracle[name] = tensor
            continue
        # Projections of one input (q, k, v; gate, up) share its act-order permutation, as
        # GPTQ's, computed from that input's statistics, does.
        layer_index = int(re.findall(r"\.(\d+)\.", name)[0])
        seed = layer_index * 100_000 + tensor.shape[1]
        layer = rtn_layer(tensor, 4, group_size, act_order, seed)
        stored.update(gptq_tensors(layer, name.removesuffix(".weight"), "gptq"))
        oracle[name] = layer.dequantized().to(tensor.dtype)
    save_file(stored, gptq_dir / "model.safetensors")
    save_file(oracle, oracle_dir / "model.safetensors")
    config = json.loads((float_model / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order,
        "sym": False, "checkpoint_format": "gptq",
    }
    (gptq_dir / "config.json").write_text(json.dumps(config))
    return gptq_dir, oracle_dir

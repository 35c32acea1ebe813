"""FP8 checkpoints written from a float one in the documented layout (vLLM / llm-compressor,
compressed-tensors, fbgemm): each decoder projection's `weight` as float8_e4m3fn with its
`weight_scale` (per tensor, shape [] / [1], or per output row, [out, 1]) and, for static
activation schemes, an `input_scale`; everything else (embeddings, norms, lm_head) stays float.
Beside it, the float checkpoint of the dequantized weights (weight * scale in float32): the
oracle an exact FP8 loader must reproduce.

Written from the formats' descriptions alone, no code shared with pytgi_shard.quantization.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
PROJECTION = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")
# Attention per tensor (q, k and v each with its own scale), the MLP per output row.
PER_TENSOR = re.compile(r"\.(q|k|v|o)_proj\.weight$")

CONFIGS: dict[str, dict[str, Any]] = {
    "fp8": {"quant_method": "fp8", "activation_scheme": "static"},
    "compressed-tensors": {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                        "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                  "dynamic": False},
        }},
        "ignore": ["lm_head"], "quantization_status": "compressed",
    },
}  # fmt: skip


def fp8_quantize(weight: torch.Tensor, per_tensor: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale [1] or [out, 1]) with weight * scale ~= `weight`."""
    w = weight.float()
    top = w.abs().max().reshape(1) if per_tensor else w.abs().amax(dim=1, keepdim=True)
    scale = top.clamp(min=1e-12) / FP8_MAX
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def dequantized(fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W = weight * scale, in float32 (exact: an e4m3 value times a float32 scale)."""
    return fp8.float() * scale


def write_fp8_checkpoint(float_model: Path, dest: Path, flavor: str) -> tuple[Path, Path]:
    """(the FP8 checkpoint, the float checkpoint of its dequantized weights) of `float_model`."""
    fp8_dir, oracle_dir = dest / f"fp8-{flavor}", dest / f"fp8-{flavor}-dequantized"
    for d in (fp8_dir, oracle_dir):
        shutil.copytree(float_model, d, ignore=shutil.ignore_patterns("*.safetensors*"))
    tensors = {}
    for file in sorted(float_model.glob("*.safetensors")):
        tensors.update(load_file(file))
    stored, oracle = {}, {}
    for name, tensor in tensors.items():
        if not PROJECTION.search(name):
            stored[name] = oracle[name] = tensor
            continue
        fp8, scale = fp8_quantize(tensor, per_tensor=bool(PER_TENSOR.search(name)))
        prefix = name.removesuffix(".weight")
        stored[name] = fp8
        stored[f"{prefix}.weight_scale"] = scale
        if PER_TENSOR.search(name):
            # Static activation scales, one per projection (the loader keeps the largest).
            stored[f"{prefix}.input_scale"] = torch.tensor([0.01 + 0.001 * len(prefix)])
        oracle[name] = dequantized(fp8, scale).to(tensor.dtype)
    save_file(stored, fp8_dir / "model.safetensors")
    save_file(oracle, oracle_dir / "model.safetensors")
    config = json.loads((float_model / "config.json").read_text())
    config["quantization_config"] = CONFIGS[flavor]
    (fp8_dir / "config.json").write_text(json.dumps(config))
    return fp8_dir, oracle_dir

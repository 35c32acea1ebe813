"""GPTQ and AWQ exports of a float Llama checkpoint, for the benchmarks: each projection
min-max quantized per group of input features (4 bits, asymmetric, float16 scales) and packed
in the format's layout by pytgi's own packers (int_packing, held to bit-loop packers written
from the documented layouts in tests/unit/shard/quantization/test_int_packing.py). Speed does not depend on
how well the integers were chosen, so no calibration (GPTQ's Hessian, AWQ's activation scales)
is run; quality proofs use the tests' exports and their dequantized float copies.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pytgi_shard.quantization.int_packing import natural_columns_to_awq, pack_int32

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_groups(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, ...]:
    """Float [out, in] -> (q [in, out], zeros [groups, out], scales float16 [groups, out])."""
    w = weight.float().t()
    grouped = w.reshape(w.shape[0] // group_size, group_size, w.shape[1])
    lo, hi = grouped.amin(1).clamp(max=0), grouped.amax(1).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-6).half()
    zeros = (-lo / scales.float()).round().clamp(1, 15).to(torch.int32)
    q = (grouped / scales.float()[:, None] + zeros[:, None]).round().clamp(0, 15)
    return q.reshape(w.shape).to(torch.int32), zeros, scales


def export(source: Path, dest: Path, method: str, group_size: int = 128) -> Path:
    """`source`'s GPTQ (v1: zeros stored minus one) or AWQ (GEMM) export at `dest`."""
    marker = dest / "export.json"
    spec = {"source": str(source), "method": method, "group_size": group_size}
    if marker.is_file() and json.loads(marker.read_text()) == spec:
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(source, dest)
    tensors = load_file(str(source / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        prefix = name.removesuffix(".weight")
        if prefix == name or prefix.rsplit(".", 1)[-1] not in PROJECTIONS:
            out[name] = tensor
            continue
        q, zeros, scales = quantize_groups(tensor, group_size)
        out[f"{prefix}.scales"] = scales
        if method == "awq":
            out[f"{prefix}.qweight"] = pack_int32(natural_columns_to_awq(q), 4, dim=1)
            out[f"{prefix}.qzeros"] = pack_int32(natural_columns_to_awq(zeros), 4, dim=1)
        else:
            out[f"{prefix}.qweight"] = pack_int32(q, 4, dim=0)
            out[f"{prefix}.qzeros"] = pack_int32(zeros - 1, 4, dim=1)
            out[f"{prefix}.g_idx"] = torch.arange(q.shape[0], dtype=torch.int32) // group_size
    save_file(out, str(dest / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    if method == "awq":
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "zero_point": True,
                                         "group_size": group_size, "version": "gemm"}  # fmt: skip
    else:
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "sym": False,
                                         "group_size": group_size, "desc_act": False,
                                         "checkpoint_format": "gptq"}  # fmt: skip
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    marker.write_text(json.dumps(spec))
    return dest

"""A checkpoint's FP8 KV-cache scales: per layer, the numbers the cache's K and V are divided by
when stored and multiplied by when read (--kv-cache-dtype, shard/attention/kv_quant.py).

Checkpoints calibrated for an FP8 cache carry them as scalars under each attention module, in
TGI's and vLLM's names: `<attention>.k_scale` and `<attention>.v_scale`, or the older single
`<attention>.kv_scale` for both (e.g. `model.layers.0.self_attn.k_scale`). The layer is the index
after `layers.`/`h.`/`blocks.` in the name. A layer the checkpoint gives no scale keeps 1.0, as in
TGI. Only the safetensors headers are scanned, and only the scale tensors read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from pytgi_shard.weights.reader import find_weight_files

# <...>.(layers|h|blocks).<index>.<attention module...>.(k_scale|v_scale|kv_scale)
_SCALE_NAME = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.(?:.+\.)?(k_scale|v_scale|kv_scale)$")


@dataclass(frozen=True, slots=True)
class LayerScales:
    """One layer's (k_scale, v_scale), and whether the checkpoint gave them."""

    key: float = 1.0
    value: float = 1.0
    from_checkpoint: bool = False


def _scalar(file: Path, name: str, handle: object) -> float:
    """The value of a one-element tensor; per-head or per-channel scales are refused (the cache
    keeps one scale per tensor per layer)."""
    tensor = handle.get_tensor(name)  # type: ignore[attr-defined]
    if tensor.numel() != 1:
        raise ValueError(
            f"{name} in {file.name} has {tensor.numel()} values: only per-tensor KV cache "
            "scales (one per layer for K and one for V) are supported"
        )
    return float(tensor.float().item())


def _found_scales(model_path: Path) -> dict[int, dict[str, float]]:
    """{layer: {"k_scale"|"v_scale"|"kv_scale": value}} for every scale the checkpoint holds."""
    found: dict[int, dict[str, float]] = {}
    for file in find_weight_files(model_path):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is no mapping)
                match = _SCALE_NAME.search(name)
                if match is not None:
                    layer = found.setdefault(int(match.group(1)), {})
                    layer[match.group(2)] = _scalar(file, name, handle)
    return found


def _layer_scales(names: dict[str, float]) -> LayerScales:
    """k_scale/v_scale when both are given, else kv_scale for both (TGI's order)."""
    if "k_scale" in names and "v_scale" in names:
        return LayerScales(names["k_scale"], names["v_scale"], True)
    if "kv_scale" in names:
        return LayerScales(names["kv_scale"], names["kv_scale"], True)
    return LayerScales()


def read_kv_scales(model_path: Path, num_layers: int) -> list[LayerScales]:
    """The scales of layers 0..num_layers-1, 1.0 where the checkpoint has none (layers past
    the served model's, such as a speculative head's, are not served and not read)."""
    found = _found_scales(model_path)
    return [_layer_scales(found.get(i, {})) for i in range(num_layers)]

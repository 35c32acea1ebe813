"""compressed-tensors (llm-compressor, Neural Magic / Red Hat) descriptions: pytgi serves their
FP8 weights (float8_e4m3fn, `weight_scale` per tensor or per output channel, optional static
`input_scale`), the "FP8" and "FP8_DYNAMIC" schemes; packed integer weights (W4A16, W8A8 int),
block and group scales and 2:4 sparsity are refused, naming the scheme.

    "quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": true,
                    "dynamic": false},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                              "dynamic": true}}},
      "ignore": ["lm_head"], "kv_cache_scheme": null}

`kv_cache_scheme` is not applied: the KV cache stays in the model's dtype (its k/v scales are
left unread). Layers in `ignore` are stored in float and read as such (the FP8 loader goes by
each weight's stored dtype).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pytgi_shard.quantization.config_fields import field, names, refuse
from pytgi_shard.quantization.errors import QuantizationError
from pytgi_shard.quantization.spec import QuantizationSpec

FLOAT_FORMATS = ("float-quantized", "naive-quantized")
WEIGHT_STRATEGIES = ("tensor", "channel")
_INSTEAD = "pytgi reads compressed-tensors FP8 weights (8-bit float, per-tensor or per-channel)"


def compressed_tensors_spec(q: Mapping[str, Any], source: str) -> QuantizationSpec:
    # Early exports nest the description under compression_config.quantization_config.
    nested = q.get("quantization_config")
    if isinstance(nested, dict) and "config_groups" in nested:
        q = {**q, **nested}
    fmt = field(q, "format", str, source) or "float-quantized"
    if fmt not in FLOAT_FORMATS:
        refuse(f"compressed-tensors format {fmt!r}", source, _INSTEAD)
    sparsity = q.get("sparsity_config")
    if isinstance(sparsity, dict) and sparsity.get("format", "dense") != "dense":
        refuse(f"compressed-tensors sparsity {sparsity.get('format')!r}", source, _INSTEAD)
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise QuantizationError(f"{source} has no `config_groups`")
    strategies, schemes = set(), set()
    for name, group in groups.items():
        where = f"{source} group {name!r}"
        if not isinstance(group, dict):
            raise QuantizationError(f"{where} is not a JSON object")
        group_format = field(group, "format", str, where) or fmt
        if group_format not in FLOAT_FORMATS:
            refuse(f"compressed-tensors format {group_format!r}", where, _INSTEAD)
        strategies.add(_weight_strategy(group.get("weights"), where))
        schemes.add(_activation_scheme(group.get("input_activations"), where))
    return QuantizationSpec(
        method="fp8", pre_quantized=True, source=source, bits=8,
        checkpoint_format="compressed-tensors",
        weight_strategy="+".join(sorted(strategies)),
        activation_scheme="+".join(sorted(s for s in schemes if s)),
        not_converted=names(q, "ignore"),
    )  # fmt: skip


def _weight_strategy(weights: object, where: str) -> str:
    if not isinstance(weights, dict):
        raise QuantizationError(f"{where} has no `weights` scheme")
    kind = field(weights, "type", str, where) or "int"
    bits = field(weights, "num_bits", int, where) or 8
    strategy = field(weights, "strategy", str, where) or "tensor"
    if kind != "float" or bits != 8:
        refuse(f"compressed-tensors {kind} {bits}-bit weights", where, _INSTEAD)
    if strategy not in WEIGHT_STRATEGIES:
        refuse(f"compressed-tensors FP8 weights with {strategy} scales", where, _INSTEAD)
    if field(weights, "dynamic", bool, where, default=False):
        refuse("compressed-tensors weights without stored scales (dynamic)", where, _INSTEAD)
    if not field(weights, "symmetric", bool, where, default=True):
        refuse("compressed-tensors FP8 weights with zero points", where, _INSTEAD)
    return strategy


def _activation_scheme(activations: object, where: str) -> str:
    """ "static" (a stored input_scale), "dynamic" (scaled per call), "" (weight-only)."""
    if activations is None:
        return ""
    if not isinstance(activations, dict):
        raise QuantizationError(f"{where} `input_activations` is not a JSON object")
    kind = field(activations, "type", str, where) or "int"
    bits = field(activations, "num_bits", int, where) or 8
    if kind != "float" or bits != 8:
        refuse(f"compressed-tensors {kind} {bits}-bit activations", where, _INSTEAD)
    return "dynamic" if field(activations, "dynamic", bool, where, default=False) else "static"

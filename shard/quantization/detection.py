"""Which quantization a checkpoint declares, read from config.json (`quantization_config`, or
`compression_config` of early compressed-tensors exports) or from the side files older
exporters write (AutoGPTQ's quantize_config.json, AutoAWQ's quant_config.json).

Each declaration becomes a QuantizationSpec, or a QuantizationError naming what pytgi does not
serve: loading such weights as plain ones goes silently wrong (FP8 weights without their
scales) or fails cryptically (GPTQ's qweight where a weight was expected).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pytgi_shard.quantization.compressed_tensors_config import compressed_tensors_spec
from pytgi_shard.quantization.config_fields import field, names, refuse
from pytgi_shard.quantization.errors import QuantizationError
from pytgi_shard.quantization.spec import QuantizationSpec

# config.json keys holding a quantization description, in the order they are looked for.
CONFIG_KEYS = ("quantization_config", "compression_config")
# Side files -> the method they imply when they do not name one.
SIDE_FILES = {"quantize_config.json": "gptq", "quant_config.json": "awq"}
GPTQ_BITS = (4, 8)
GPTQ_FORMATS = ("gptq", "gptq_v2")
# What a refusal suggests instead.
_INSTEAD = (
    "pytgi serves gptq, awq, fp8 and compressed-tensors fp8 checkpoints, and quantizes float "
    "checkpoints on load with --quantize"
)


def quantization_method(description: Mapping[str, Any]) -> str:
    """The method a description names; bitsandbytes configs written before `quant_method`
    existed carry only load_in_4bit / load_in_8bit, early compressed-tensors ones only their
    config_groups."""
    method = description.get("quant_method") or description.get("quant_type")
    if isinstance(method, str) and method:
        return method.lower()
    if description.get("load_in_4bit") or description.get("load_in_8bit"):
        return "bitsandbytes"
    nested = description.get("quantization_config")
    if "config_groups" in description or (isinstance(nested, dict) and "config_groups" in nested):
        return "compressed-tensors"
    return "unknown method"


def detect_quantization(model_path: Path, config: Mapping[str, Any]) -> QuantizationSpec | None:
    """The checkpoint's own quantization, None for a float checkpoint."""
    for key in CONFIG_KEYS:
        if config.get(key):
            return spec_from_description(config[key], f"config.json `{key}`")
    for name, default in SIDE_FILES.items():
        side = model_path / name
        if side.is_file():
            try:
                description = json.loads(side.read_text())
            except ValueError as e:
                raise QuantizationError(f"{side} is not valid JSON: {e}") from e
            if isinstance(description, dict):
                description = {"quant_method": default, **description}
            return spec_from_description(description, name)
    return None


def spec_from_description(description: object, source: str) -> QuantizationSpec:
    if not isinstance(description, dict):
        raise QuantizationError(f"{source} is not a JSON object: {description!r}")
    method = quantization_method(description)
    parse = _PARSERS.get(method)
    if parse is None:
        raise QuantizationError(_unsupported(method, source))
    return parse(description, source)


def _unsupported(method: str, source: str) -> str:
    if method == "bitsandbytes":
        return (
            f"pre-quantized bitsandbytes checkpoints (declared by {source}) are not supported: "
            "serve the float checkpoint with --quantize bitsandbytes, bitsandbytes-nf4 or "
            "bitsandbytes-fp4, which quantizes it on load"
        )
    return f"{method} checkpoints (declared by {source}) are not supported: {_INSTEAD}"


def gptq_spec(q: Mapping[str, Any], source: str) -> QuantizationSpec:
    """HF's GPTQConfig / AutoGPTQ's and GPTQModel's quantize_config: 4- or 8-bit, v1 or v2."""
    bits = field(q, "bits", int, source, required=True)
    if bits not in GPTQ_BITS:
        refuse(f"gptq {bits}-bit", source, "pytgi serves 4- and 8-bit GPTQ")
    if q.get("is_marlin_format"):
        refuse(
            "gptq in Marlin's repacked layout (is_marlin_format)",
            source,
            "serve the plain GPTQ export (--quantize marlin takes that one)",
        )
    fmt = field(q, "checkpoint_format", str, source) or field(q, "format", str, source) or "gptq"
    if fmt.lower() not in GPTQ_FORMATS:
        refuse(
            f"gptq checkpoint_format {fmt!r}", source, f"pytgi reads {' and '.join(GPTQ_FORMATS)}"
        )
    if q.get("lm_head"):
        refuse("gptq with a quantized lm_head", source, "pytgi keeps lm_head in float")
    return QuantizationSpec(
        method="gptq", pre_quantized=True, source=source, bits=bits,
        group_size=_group_size(field(q, "group_size", int, source, default=128)),
        desc_act=bool(field(q, "desc_act", bool, source, default=False)),
        sym=bool(field(q, "sym", bool, source, default=True)),
        checkpoint_format=fmt.lower(),
    )  # fmt: skip


def awq_spec(q: Mapping[str, Any], source: str) -> QuantizationSpec:
    """HF's AwqConfig, or AutoAWQ's quant_config.json (w_bit, q_group_size): GEMM packing."""
    bits = field(q, "bits" if "bits" in q else "w_bit", int, source, required=True)
    if bits != 4:
        refuse(f"awq {bits}-bit", source, "AWQ's GEMM packing is 4-bit")
    version = (field(q, "version", str, source) or "gemm").lower()
    if version != "gemm":
        refuse(f"awq version {version!r}", source, "pytgi reads AWQ's GEMM packing only")
    group = field(
        q, "group_size" if "group_size" in q else "q_group_size", int, source, default=128
    )
    return QuantizationSpec(
        method="awq", pre_quantized=True, source=source, bits=bits,
        group_size=_group_size(group),
        zero_point=bool(field(q, "zero_point", bool, source, default=True)),
        checkpoint_format="gemm", not_converted=names(q, "modules_to_not_convert"),
    )  # fmt: skip


def fp8_spec(q: Mapping[str, Any], source: str) -> QuantizationSpec:
    """quant_method fp8 (vLLM / llm-compressor's older exports, HF's FineGrainedFP8Config):
    float8_e4m3fn weights with a `weight_scale` each; block-wise scales refused."""
    block = q.get("weight_block_size")
    if block:
        refuse(
            f"fp8 with block-wise weight scales (weight_block_size {block})",
            source,
            "pytgi reads per-tensor and per-channel FP8 scales",
        )
    fmt = (field(q, "fmt", str, source) or "e4m3").lower()
    if fmt != "e4m3":
        refuse(f"fp8 in format {fmt}", source, "pytgi reads float8_e4m3fn weights")
    scheme = (field(q, "activation_scheme", str, source) or "dynamic").lower()
    if scheme not in ("dynamic", "static"):
        refuse(f"fp8 activation_scheme {scheme!r}", source, "dynamic or static are read")
    return QuantizationSpec(
        method="fp8", pre_quantized=True, source=source, bits=8, checkpoint_format="fp8",
        weight_strategy="tensor", activation_scheme=scheme,
        not_converted=names(q, "ignored_layers", "modules_to_not_convert"),
    )  # fmt: skip


def fbgemm_fp8_spec(q: Mapping[str, Any], source: str) -> QuantizationSpec:
    """HF's FbgemmFp8Config: float8_e4m3fn weights, one scale per output row, activations
    scaled per token at run time (TGI serves it as fp8 too)."""
    return QuantizationSpec(
        method="fp8", pre_quantized=True, source=source, bits=8, checkpoint_format="fbgemm_fp8",
        weight_strategy="channel", activation_scheme="dynamic",
        not_converted=names(q, "modules_to_not_convert"),
    )  # fmt: skip


def _group_size(value: int | None) -> int | None:
    """GPTQ's -1 (one group over all input features) as None; other non-positive sizes are
    malformed."""
    if value is None or value == -1:
        return None
    if value <= 0:
        raise QuantizationError(f"group_size must be -1 or positive, got {value}")
    return value


_PARSERS: Mapping[str, Callable[[Mapping[str, Any], str], QuantizationSpec]] = {
    "gptq": gptq_spec,
    "awq": awq_spec,
    "fp8": fp8_spec,
    "fbgemm_fp8": fbgemm_fp8_spec,
    "compressed-tensors": compressed_tensors_spec,
}

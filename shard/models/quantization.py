"""Refusing quantized checkpoints: pytgi has no quantized kernels yet.

Loaded as if they were plain weights, they go silently wrong (an FP8 checkpoint's weights are
cast and its `weight_scale` ignored) or fail cryptically (GPTQ/AWQ: "weight not found"). Until
quantization exists, any checkpoint that declares one is refused at start-up, naming the method.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

# Files older GPTQ / AWQ exporters write next to config.json instead of a quantization_config.
_SIDE_FILES = {"quantize_config.json": "gptq", "quant_config.json": "awq"}
# Config keys holding a quantization description (compression_config: early compressed-tensors).
_CONFIG_KEYS = ("quantization_config", "compression_config")


def quantization_method(quantization: object) -> str:
    """The method a quantization description names ("fp8", "gptq", ...), for the error message.
    bitsandbytes configs written before `quant_method` existed only carry load_in_4bit/8bit."""
    if isinstance(quantization, dict):
        method = quantization.get("quant_method") or quantization.get("quant_type")
        if isinstance(method, str) and method:
            return method
        if quantization.get("load_in_4bit") or quantization.get("load_in_8bit"):
            return "bitsandbytes"
    return "unknown method"


def check_not_quantized(model_path: Path, config: Mapping[str, Any]) -> None:
    """Raises a ValueError naming the method if the checkpoint at `model_path` is quantized."""
    where, method = "", ""
    for key in _CONFIG_KEYS:
        if config.get(key):
            where, method = f"config.json `{key}`", quantization_method(config[key])
            break
    else:
        for name, default in _SIDE_FILES.items():
            if (model_path / name).is_file():
                where, method = name, default
                break
    if where:
        raise ValueError(
            f"{model_path} is a quantized checkpoint ({method}, declared by {where}): pytgi "
            "does not support quantization yet and would load its weights wrongly; serve the "
            "unquantized (bf16/fp16/fp32) checkpoint instead"
        )

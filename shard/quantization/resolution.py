"""The quantization a model runs with: the checkpoint's own (detected from config.json) and
--quantize, reconciled once at start-up by the launcher (to log it and fail before spawning
anything) and by each shard (which loads with it).

A pre-quantized checkpoint needs no flag; a flag naming its method (or TGI's other name for it:
marlin for GPTQ, compressed-tensors or fp8 for compressed-tensors FP8) is accepted, any other
flag contradicts it and is refused. On a float checkpoint the flag asks for quantize-on-load,
which the checkpoint methods (gptq, awq, compressed-tensors) cannot do.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pytgi_shard.quantization.detection import detect_quantization
from pytgi_shard.quantization.errors import QuantizationError
from pytgi_shard.quantization.method import ON_LOAD, served_method
from pytgi_shard.quantization.spec import QuantizationSpec

log = logging.getLogger(__name__)


def resolve_quantization(
    model_path: Path, config: Mapping[str, Any], flag: str | None
) -> QuantizationSpec | None:
    """The spec to load `model_path` with (None: float weights), or a QuantizationError."""
    detected = detect_quantization(model_path, config)
    spec = reconcile(flag, detected, model_path)
    if flag == "marlin":
        log.info(
            "--quantize marlin: pytgi has no Marlin kernel; the GPTQ checkpoint runs on "
            "pytgi's GPTQ kernels (the start-up log names them once the model is loaded)"
        )
    if spec is not None and spec.method == "bitsandbytes":
        log.warning(
            "bitsandbytes 8-bit is slow (TGI deprecates it): eetq is int8 weight-only "
            "too, and faster"
        )
    return spec


def reconcile(
    flag: str | None, detected: QuantizationSpec | None, model_path: Path
) -> QuantizationSpec | None:
    if flag is None:
        return detected
    wanted = served_method(flag)
    if detected is not None:
        if not _agrees(wanted, detected):
            raise QuantizationError(
                f"--quantize {flag} contradicts the checkpoint at {model_path}, which is "
                f"{detected.method} (declared by {detected.source}); pre-quantized checkpoints "
                "are detected: leave --quantize out"
            )
        return dataclasses.replace(detected, requested=flag)
    if wanted not in ON_LOAD:
        raise QuantizationError(
            f"--quantize {flag} needs a {wanted} checkpoint, but {model_path} declares no "
            "quantization (config.json has no quantization_config); pytgi quantizes float "
            f"checkpoints on load with {', '.join(ON_LOAD)}"
        )
    return QuantizationSpec(method=wanted, pre_quantized=False, source="--quantize", requested=flag)


def _agrees(wanted: str, detected: QuantizationSpec) -> bool:
    if wanted == "compressed-tensors":
        return detected.checkpoint_format == "compressed-tensors"
    return wanted == detected.method

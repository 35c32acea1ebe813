"""The one table from a quantization method to the classes that hold and multiply its weights,
and the LinearFormat a checkpoint's Weights are built with.

ON_LOAD: method -> the function that quantizes one float weight as it is read (a QuantizedWeight
class's from_float). PRE_QUANTIZED: method -> the LinearLoader of its checkpoints, built from the
spec. A method missing from its table has no kernel in this build and is refused at start-up.
Tests pass their own tables (`linear_format(spec, on_load=..., pre_quantized=...)`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch

from pytgi_shard.quantization.awq import AWQLoader
from pytgi_shard.quantization.bitsandbytes_weight import BnbFp4Weight, BnbInt8Weight, BnbNf4Weight
from pytgi_shard.quantization.errors import QuantizationError
from pytgi_shard.quantization.fp8_checkpoint import Fp8CheckpointLoader
from pytgi_shard.quantization.fp8_weight import Fp8Weight
from pytgi_shard.quantization.gptq import GPTQLoader
from pytgi_shard.quantization.int8_weight_only import Int8WeightOnly
from pytgi_shard.quantization.linear_format import (
    DENSE,
    LinearFormat,
    pre_quantized_format,
    quantized_on_load,
)
from pytgi_shard.quantization.linear_weight import LinearLoader, QuantizedWeight
from pytgi_shard.quantization.spec import QuantizationSpec

OnLoadKernel = Callable[[torch.Tensor], QuantizedWeight]
CheckpointLoader = Callable[[QuantizationSpec], LinearLoader]


def _gptq(spec: QuantizationSpec) -> LinearLoader:
    return GPTQLoader(
        spec.bits or 4,
        spec.group_size or -1,
        spec.desc_act,
        spec.sym,
        spec.checkpoint_format or "gptq",
    )


def _awq(spec: QuantizationSpec) -> LinearLoader:
    return AWQLoader(
        spec.bits or 4, spec.group_size or -1, spec.zero_point, spec.checkpoint_format or "gemm"
    )


def _fp8(spec: QuantizationSpec) -> LinearLoader:
    return Fp8CheckpointLoader(Fp8Weight)


ON_LOAD: Mapping[str, OnLoadKernel] = MappingProxyType(
    {
        "bitsandbytes": BnbInt8Weight.from_float,
        "bitsandbytes-nf4": BnbNf4Weight.from_float,
        "bitsandbytes-fp4": BnbFp4Weight.from_float,
        "eetq": Int8WeightOnly.from_float,
        "fp8": Fp8Weight.from_float,
    }
)
PRE_QUANTIZED: Mapping[str, CheckpointLoader] = MappingProxyType(
    {
        "gptq": _gptq,
        "awq": _awq,
        "fp8": _fp8,
    }
)


def linear_format(
    spec: QuantizationSpec | None,
    on_load: Mapping[str, OnLoadKernel] = ON_LOAD,
    pre_quantized: Mapping[str, CheckpointLoader] = PRE_QUANTIZED,
) -> LinearFormat:
    """How the linears of a checkpoint with `spec` are read; a QuantizationError when this build
    has no kernel for it."""
    if spec is None:
        return DENSE
    if spec.pre_quantized:
        loader = pre_quantized.get(spec.method)
        if loader is None:
            raise _unavailable(f"{spec.method} checkpoints", pre_quantized)
        return pre_quantized_format(spec.method, loader(spec))
    quantize = on_load.get(spec.method)
    if quantize is None:
        raise _unavailable(f"--quantize {spec.method} (on load)", on_load)
    return quantized_on_load(spec.method, quantize)


def _unavailable(what: str, table: Mapping[str, object]) -> QuantizationError:
    built = ", ".join(sorted(table)) or "none"
    return QuantizationError(
        f"{what} cannot be served: this build has no kernel for it (available: {built})"
    )

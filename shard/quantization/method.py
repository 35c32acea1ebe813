"""The --quantize values: TGI's names, what each means in pytgi, and the parsing of the flag.

Two kinds. On-load methods quantize a float checkpoint's linear weights as they are read
(bitsandbytes 8-bit, its nf4 and fp4 4-bit formats, eetq int8 weight-only, fp8). Checkpoint
methods name how a pre-quantized checkpoint is stored (gptq, awq, fp8, compressed-tensors);
those are also detected from config.json without a flag, so the flag only confirms them.
`marlin` is TGI's name for a GPTQ checkpoint served by the Marlin kernel: pytgi accepts it and
serves the checkpoint through its GPTQ path. TGI's `exl2` is refused: pytgi has no ExLlamaV2
format reader.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from types import MappingProxyType

# Quantized on load from a float checkpoint.
ON_LOAD = ("bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4", "eetq", "fp8")
# Read as stored (config.json names them); fp8 is both: a float checkpoint or an FP8 one.
CHECKPOINT = ("gptq", "awq", "fp8", "compressed-tensors")
# TGI's names for a checkpoint method served by another kernel -> the method pytgi serves.
ALIASES: Mapping[str, str] = MappingProxyType({"marlin": "gptq"})
# TGI values pytgi refuses, with the one line that says why.
REFUSED: Mapping[str, str] = MappingProxyType(
    {
        "exl2": "--quantize exl2 (ExLlamaV2 checkpoints) is not supported by pytgi; serve a GPTQ "
        "or AWQ export of the model instead",
    }
)
# Every value the flag accepts, in TGI's order of its documentation.
VALUES = (
    "awq",
    "compressed-tensors",
    "eetq",
    "exl2",
    "gptq",
    "marlin",
    "bitsandbytes",
    "bitsandbytes-nf4",
    "bitsandbytes-fp4",
    "fp8",
)


def parse_quantize(value: str) -> str:
    """A --quantize / QUANTIZE value as given (lower-cased), or an ArgumentTypeError listing the
    valid ones; a TGI value pytgi refuses says why. argparse shows the message as it is."""
    name = value.strip().lower()
    if name in REFUSED:
        raise argparse.ArgumentTypeError(REFUSED[name])
    if name not in VALUES:
        valid = ", ".join(v for v in VALUES if v not in REFUSED)
        raise argparse.ArgumentTypeError(f"unknown quantization {value!r}; valid values: {valid}")
    return name


def served_method(name: str) -> str:
    """The method pytgi runs for a --quantize value (marlin -> gptq)."""
    return ALIASES.get(name, name)

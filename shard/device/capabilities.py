"""What this shard's device can run, decided once at start-up and handed down (Dist.caps).

Before, each layer asked on its own ("is this CUDA, is Triton importable, did the operator pass
--disable-custom-kernels?") in three styles; one answer now reaches every layer through
`weights.dist.caps`, so a new kernel or a new device kind changes this table, not the layers.

`resolve_capabilities` takes plain values (the table, tested without a GPU);
`probe_capabilities` reads them from the device, the import system and the environment at the
moment it is called (never at import time).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch

REFERENCE_ATTENTION = "reference"
TRITON_ATTENTION = "triton"


@dataclass(frozen=True)
class DeviceCapabilities:
    """The kernel and execution choices one device allows, under the operator's settings."""

    # torch.device.type: "cuda", "cpu", ...
    kind: str
    # `triton` importable in this environment.
    triton_installed: bool
    # TRITON_INTERPRET=1: Triton kernels would run in its CPU interpreter (the tests' mode; the
    # layers still take their eager path there, only explicit kernel calls use it).
    triton_interpreter: bool
    # False under --disable-custom-kernels: plain PyTorch everywhere.
    custom_kernels: bool
    # The layers' fused Triton kernels (norm, rotary, activation, MoE): CUDA with Triton.
    triton_kernels: bool
    # GPTQ/AWQ weights multiply through the Triton dequantize-GEMM (quantization/
    # int_kernel_choice.py) rather than dequantizing whole each call.
    triton_dequant_gemm: bool
    # The attention backend used when --attention is not given.
    default_attention: str
    # The device can capture and replay CUDA graphs (settings and model may still rule them
    # out: engine/decode_graphs.graphs_off_reason).
    cuda_graphs: bool
    # The forward only queues work, so the next step's forward may be queued before the tokens
    # are read back (the --overlap default, engine/lookahead.py).
    async_forward: bool


def resolve_capabilities(
    kind: str, *, triton_installed: bool, triton_interpreter: bool = False,
    custom_kernels: bool = True,
) -> DeviceCapabilities:  # fmt: skip
    """The capability table from plain values: what runs where, in one place."""
    cuda = kind == "cuda"
    triton_kernels = cuda and triton_installed and custom_kernels
    return DeviceCapabilities(
        kind=kind,
        triton_installed=triton_installed,
        triton_interpreter=triton_interpreter,
        custom_kernels=custom_kernels,
        triton_kernels=triton_kernels,
        # As before the split: chosen on CUDA unless custom kernels are off (the kernel module
        # imports Triton where it is built).
        triton_dequant_gemm=cuda and custom_kernels,
        default_attention=TRITON_ATTENTION if triton_kernels else REFERENCE_ATTENTION,
        cuda_graphs=cuda,
        async_forward=cuda,
    )


def probe_capabilities(device: torch.device, custom_kernels: bool = True) -> DeviceCapabilities:
    """The capabilities of `device` in this process: whether Triton imports and whether its
    interpreter is on are read now (start-up), not when this module is imported."""
    return resolve_capabilities(
        device.type,
        triton_installed=importlib.util.find_spec("triton") is not None,
        triton_interpreter=os.environ.get("TRITON_INTERPRET") == "1",
        custom_kernels=custom_kernels,
    )

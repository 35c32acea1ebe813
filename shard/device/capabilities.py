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
# torch._scaled_mm (FP8 tensor cores): Ada and Hopper onwards.
SCALED_MM_MIN_CAPABILITY = (8, 9)
# torch._int_mm on the CPU is only faster than dequantizing with AVX-512 (int8_weight_only.py).
INT_MM_CPU_CAPABILITY = "AVX512"


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
    # FP8 weights multiply through torch._scaled_mm (fp8_weight.py) rather than dequantizing.
    fp8_scaled_mm: bool
    # EETQ-style int8 weights multiply through torch._int_mm (int8_weight_only.py).
    int8_int_mm: bool
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
    custom_kernels: bool = True, cuda_capability: tuple[int, int] | None = None,
    cpu_capability: str = "",
) -> DeviceCapabilities:  # fmt: skip
    """The capability table from plain values: what runs where, in one place. `cuda_capability`
    is the GPU's (major, minor) compute capability (None: unknown, as for a CUDA device only
    described on a machine without one); `cpu_capability` torch's CPU ISA level ("AVX512")."""
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
        # PyTorch's own ops, not custom kernels: --disable-custom-kernels leaves them on.
        fp8_scaled_mm=scaled_mm_runs(kind, cuda_capability),
        int8_int_mm=int_mm_fast(kind, cpu_capability),
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
        cuda_capability=cuda_capability_of(device),
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
    )


def scaled_mm_runs(kind: str, cuda_capability: tuple[int, int] | None) -> bool:
    """Whether torch._scaled_mm has FP8 tensor cores to run on. Apart from the table so that a
    weight built outside start-up asks only this (no Triton import probe per layer)."""
    return (
        kind == "cuda"
        and cuda_capability is not None
        and cuda_capability >= SCALED_MM_MIN_CAPABILITY
    )


def int_mm_fast(kind: str, cpu_capability: str) -> bool:
    """Whether torch._int_mm beats dequantizing an int8 weight (measured: int8_weight_only.py)."""
    return kind == "cuda" or (kind == "cpu" and cpu_capability == INT_MM_CPU_CAPABILITY)


def cuda_capability_of(device: torch.device) -> tuple[int, int] | None:
    """The GPU's compute capability; None off CUDA, or for a CUDA device only described on a
    machine without one (tests)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)

"""Where the Triton kernel tests run, decided once: under Triton's interpreter on the CPU
(tests/conftest.py sets TRITON_INTERPRET=1 without a GPU), compiled on CUDA when a GPU is
present; the module is skipped without triton, or with neither. The interpreter computes a
bf16 tl.dot wrongly (numpy has no bf16), so bf16 is a dtype on CUDA only."""

from __future__ import annotations

import os

import pytest
import torch


def triton_device() -> tuple[torch.device, bool]:
    """(the device to run on, whether the interpreter runs the kernels); called at a test
    module's top, so its skips skip the whole module."""
    pytest.importorskip("triton", reason="triton is not installed")
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if interpreted:
        return torch.device("cpu"), True
    if torch.cuda.is_available():
        return torch.device("cuda"), False
    pytest.skip("no GPU and TRITON_INTERPRET is not set", allow_module_level=True)


def kernel_dtypes(interpreted: bool) -> list[torch.dtype]:
    """The dtypes a kernel is checked in: bf16 only when compiled (see the module's note)."""
    return [torch.float32, torch.float16] + ([] if interpreted else [torch.bfloat16])

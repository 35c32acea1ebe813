"""The capability table (device/capabilities.py): what each device kind runs under each setting,
checked from plain values, so the CUDA rows run on a CPU-only machine."""

from __future__ import annotations

import pytest
import torch

from pytgi_shard.device.capabilities import probe_capabilities, resolve_capabilities
from pytgi_shard.device.distributed import Dist, single_process


def test_cpu_runs_plain_pytorch() -> None:
    caps = resolve_capabilities("cpu", triton_installed=True)
    assert not caps.triton_kernels and not caps.triton_dequant_gemm
    assert caps.default_attention == "reference"
    assert not caps.cuda_graphs and not caps.async_forward


def test_cpu_with_the_interpreter_still_defaults_to_eager_layers() -> None:
    """TRITON_INTERPRET only lets explicit kernel calls run (the tests): the layers stay eager."""
    caps = resolve_capabilities("cpu", triton_installed=True, triton_interpreter=True)
    assert caps.triton_interpreter
    assert not caps.triton_kernels and caps.default_attention == "reference"


def test_cuda_with_triton_takes_every_custom_kernel() -> None:
    caps = resolve_capabilities("cuda", triton_installed=True)
    assert caps.triton_kernels and caps.triton_dequant_gemm
    assert caps.default_attention == "triton"
    assert caps.cuda_graphs and caps.async_forward


def test_cuda_without_triton_keeps_graphs_and_overlap() -> None:
    caps = resolve_capabilities("cuda", triton_installed=False)
    assert not caps.triton_kernels and caps.default_attention == "reference"
    assert caps.cuda_graphs and caps.async_forward


@pytest.mark.parametrize("kind", ["cuda", "cpu"])
def test_custom_kernels_off_means_plain_pytorch(kind: str) -> None:
    """--disable-custom-kernels: no Triton anywhere, whatever the device; graphs and overlap
    are not kernels and stay the device's."""
    caps = resolve_capabilities(kind, triton_installed=True, custom_kernels=False)
    assert not caps.custom_kernels
    assert not caps.triton_kernels and not caps.triton_dequant_gemm
    assert caps.default_attention == "reference"
    assert caps.cuda_graphs is caps.async_forward is (kind == "cuda")


def test_probe_reads_the_interpreter_switch_when_called(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert probe_capabilities(torch.device("cpu")).triton_interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not probe_capabilities(torch.device("cpu")).triton_interpreter


def test_dist_without_caps_gets_the_devices_defaults() -> None:
    cpu = torch.device("cpu")
    assert single_process(cpu).caps == probe_capabilities(cpu)
    plain = resolve_capabilities("cpu", triton_installed=False, custom_kernels=False)
    assert single_process(cpu, plain).caps is plain
    assert Dist(0, 2, cpu, None, plain).caps is plain


@pytest.mark.parametrize(
    ("kind", "cuda_capability", "cpu_capability", "scaled_mm", "int_mm"),
    [
        ("cuda", (9, 0), "", True, True),  # Hopper: FP8 tensor cores
        ("cuda", (8, 0), "", False, True),  # Ampere: FP8 dequantizes
        ("cuda", None, "", False, True),  # a CUDA device only described
        ("cpu", None, "AVX512", False, True),
        ("cpu", None, "AVX2", False, False),
        ("mps", None, "AVX512", False, False),
    ],
)
def test_quantized_matmul_kernels(
    kind: str, cuda_capability: tuple[int, int] | None, cpu_capability: str,
    scaled_mm: bool, int_mm: bool,
) -> None:  # fmt: skip
    """PyTorch's FP8 and int8 GEMMs are not custom kernels: --disable-custom-kernels keeps them."""
    for custom in (True, False):
        caps = resolve_capabilities(
            kind, triton_installed=True, custom_kernels=custom,
            cuda_capability=cuda_capability, cpu_capability=cpu_capability,
        )  # fmt: skip
        assert (caps.fp8_scaled_mm, caps.int8_int_mm) == (scaled_mm, int_mm)

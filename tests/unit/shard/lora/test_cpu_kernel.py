"""The fused LoRA CPU kernel (shard/lora/cpu_lora.cpp through cpu_kernel.py and LoraLinear's
CPU_KERNEL_PATH) against the row-by-row float32 reference and against the torch ops path on the
same layer and rows: plain and fused (split) layers, float32, bfloat16 and float16, rows of
every slot including the base model's (slot 0), a cleared slot, an empty slot and ranks below
the capacity. Also its fallbacks: tensors it does not read go to the torch ops, and a build that
fails logs one warning and leaves the torch path."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from pytgi_shard.device.capabilities import resolve_capabilities
from pytgi_shard.device.distributed import single_process
from pytgi_shard.lora import cpu_kernel, torch_lora
from pytgi_shard.lora.attach import lora_path
from pytgi_shard.lora.layer import CPU_KERNEL_PATH, TORCH_PATH, LoraLinear, RowAdapters

CPU = torch.device("cpu")


class _Zero(torch.nn.Module):
    """A base layer whose output is zeros, so the update alone is compared."""

    def __init__(self, out: int) -> None:
        super().__init__()
        self.out = out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(*x.shape[:-1], self.out)


@pytest.fixture(scope="module")
def built() -> object:
    """The kernel, built (or loaded from torch's cache) once for the module. Where g++ and
    ninja exist it must build; elsewhere the torch path serves and these tests are skipped."""
    if not (shutil.which("g++") and shutil.which("ninja")):
        pytest.skip("no g++/ninja: the torch ops path serves (test_lora_paths.py)")
    module = cpu_kernel.load()
    assert module is not None, "g++ and ninja exist but the LoRA CPU kernel did not build"
    return module


def layers(pieces: tuple[int, ...], k: int, dtype: torch.dtype, seed: int,
           capacity: int = 8) -> tuple[LoraLinear, LoraLinear]:
    """The same adapters in a kernel layer and a torch-ops layer of 6 slots: slot 1 at full
    rank, slot 2 below it, slot 3 set then cleared, slot 4 at rank 1 per piece, slot 5 never
    set."""
    n, count = sum(pieces), len(pieces)
    out = []
    for path in (CPU_KERNEL_PATH, TORCH_PATH):
        gen = torch.Generator().manual_seed(seed)
        layer = LoraLinear(_Zero(n), RowAdapters(), in_features=k, out_features=n, slots=6,
                           max_rank=capacity * count, dtype=dtype, device=CPU, path=path,
                           pieces=pieces)
        for slot, r in ((1, capacity), (2, capacity - 3), (3, 2), (4, 1)):
            layer.set_slot(slot, (torch.randn(count * r, k, generator=gen) * 0.5).to(dtype),
                           (torch.randn(n, count * r, generator=gen) * 0.5).to(dtype))
        layer.set_slot(3, None, None)
        out.append(layer)
    return out[0], out[1]


def run(layer: LoraLinear, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    layer.rows.bind(index)
    try:
        return layer(x)
    finally:
        layer.rows.clear()


TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pieces,k", [((10,), 12), ((40,), 37), ((24, 8, 8), 16),
                                      ((36, 20), 100)])
@pytest.mark.parametrize("tokens", [1, 7, 64, 131])
def test_kernel_matches_the_reference_and_the_torch_path(
        built: object, dtype: torch.dtype, pieces: tuple[int, ...], k: int,
        tokens: int) -> None:
    kernel_layer, torch_layer = layers(pieces, k, dtype, seed=tokens + k)
    assert kernel_layer.kernel is built and torch_layer.kernel is None
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, k, generator=gen).to(dtype)
    index = torch.randint(0, 6, (tokens,), generator=gen)
    got = run(kernel_layer, x, index)
    want = torch_lora.reference_update(x, kernel_layer.a, kernel_layer.bt, index)
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), want, atol=tol * max(1.0, float(want.abs().max())),
                               rtol=tol)
    torch.testing.assert_close(got.float(), run(torch_layer, x, index).float(),
                               atol=tol * max(1.0, float(want.abs().max())), rtol=tol)
    # Base rows, the cleared slot's and the never-set slot's get nothing.
    untouched = (index == 0) | (index == 3) | (index == 5)
    assert torch.equal(got[untouched], torch.zeros_like(got[untouched]))


def test_kernel_adds_onto_the_base_output_in_place_for_any_leading_shape(built: object) -> None:
    """A [batch, seq, features] input (contiguous) is read as its flat rows; the update lands
    on the base layer's own output."""
    kernel_layer, _ = layers((6, 4), 12, torch.float32, seed=3)
    x = torch.randn(2, 5, 12)
    index = torch.tensor([1, 0, 2, 4, 1, 3, 2, 2, 0, 1])
    y = torch.randn(2, 5, 10)
    kernel_layer.rows.bind(index)
    got = kernel_layer._add_updates(x, y.clone())
    want = y.reshape(10, 10) + torch_lora.reference_update(
        x.reshape(10, 12), kernel_layer.a, kernel_layer.bt, index)
    torch.testing.assert_close(got.reshape(10, 10), want, atol=1e-5, rtol=1e-5)


def test_tensors_the_kernel_does_not_read_take_the_torch_path(built: object) -> None:
    """A strided input (not rows of contiguous features) and an int32 index: the kernel
    declines without touching the output, and the torch ops give the reference."""
    kernel_layer, _ = layers((10,), 12, torch.float32, seed=5)
    wide = torch.randn(9, 24)
    x = wide[:, ::2]
    index = torch.tensor([1, 2, 0, 4, 4, 1, 2, 3, 0])
    out = torch.zeros(9, 10)
    assert not built.add_lora(out, x, kernel_layer.at, list(kernel_layer.b_pieces), index,  # type: ignore[attr-defined]
                              kernel_layer.ranks)
    assert not built.add_lora(out, x.contiguous(), kernel_layer.at,  # type: ignore[attr-defined]
                              list(kernel_layer.b_pieces), index.int(), kernel_layer.ranks)
    assert torch.equal(out, torch.zeros(9, 10))
    want = torch_lora.reference_update(x, kernel_layer.a, kernel_layer.bt, index)
    torch.testing.assert_close(run(kernel_layer, x, index), want, atol=1e-5, rtol=1e-5)


def test_a_slot_index_outside_the_slots_is_an_error(built: object) -> None:
    kernel_layer, _ = layers((10,), 12, torch.float32, seed=6)
    with pytest.raises(RuntimeError, match="slot index 6 outside 0..5"):
        run(kernel_layer, torch.randn(3, 12), torch.tensor([1, 6, 0]))


def test_a_failed_build_logs_one_line_and_the_layers_take_the_torch_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A source that does not compile (as a missing compiler would): load() gives None with one
    warning, lora_path picks the torch ops, and a layer asked for the kernel computes the
    update with torch ops."""
    broken = tmp_path / "cpu_lora.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(cpu_kernel, "SOURCE", broken)
    cpu_kernel.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_kernel.__name__):
            assert cpu_kernel.load() is None
        lines = [r for r in caplog.records if r.name == cpu_kernel.__name__]
        assert len(lines) == 1 and "could not be built" in lines[0].getMessage()
        assert lora_path(single_process(CPU), CPU) == TORCH_PATH
        kernel_layer, _ = layers((6, 4), 12, torch.float32, seed=7)
        assert kernel_layer.kernel is None
        x, index = torch.randn(5, 12), torch.tensor([0, 1, 2, 4, 1])
        want = torch_lora.reference_update(x, kernel_layer.a, kernel_layer.bt, index)
        torch.testing.assert_close(run(kernel_layer, x, index), want, atol=1e-5, rtol=1e-5)
    finally:
        cpu_kernel.load.cache_clear()


def test_the_cpu_picks_the_kernel_unless_custom_kernels_are_off(built: object) -> None:
    assert lora_path(single_process(CPU), CPU) == CPU_KERNEL_PATH
    off = resolve_capabilities("cpu", triton_installed=False, custom_kernels=False)
    assert lora_path(single_process(CPU, off), CPU) == TORCH_PATH

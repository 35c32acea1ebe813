"""What TGI's --rope-scaling/--rope-factor and --disable-custom-kernels change in a shard: the
rotary embedding the model is built with, the attention backend, and every fused-kernel choice
(layers' Triton kernels, the GPTQ/AWQ kernel table)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pytgi_shard.device.capabilities import probe_capabilities
from pytgi_shard.device.distributed import Dist
from pytgi_shard.layers.rotary import default_inv_freq
from pytgi_shard.models.config_layout import legacy_layout
from pytgi_shard.quantization.int4pack_layout import int4pack_layout
from pytgi_shard.quantization.int_kernel_choice import IntKernel, choose_int_kernel
from pytgi_shard.service.startup import StartupRefused, load_engine, read_config, resolve_attention
from pytgi_shard.settings import ShardSettings

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


def rotary_of(model_dir: Path, **flags: object) -> object:
    engine = load_engine(ShardSettings(model_path=model_dir, **flags))  # type: ignore[arg-type]
    return engine.model.rotary  # type: ignore[attr-defined]


def test_rope_override_replaces_the_config_scaling(tiny_model: Callable[..., Path]) -> None:
    """The tiny Llama's config.json says llama3 scaling; the flags replace it in the model."""
    model_dir = tiny_model("llama")
    written = legacy_layout(json.loads((model_dir / "config.json").read_text()))
    assert written["rope_scaling"]["rope_type"] == "llama3"  # transformers 5 writes rope_parameters
    head_dim = 64 // 4
    plain = default_inv_freq(head_dim, 10000.0)
    linear = rotary_of(model_dir, rope_scaling="linear", rope_factor=4.0)
    torch.testing.assert_close(linear.inv_freq, plain / 4.0)  # type: ignore[attr-defined]
    dynamic = rotary_of(model_dir, rope_scaling="dynamic")
    assert dynamic.dynamic_factor == 1.0  # type: ignore[attr-defined]
    torch.testing.assert_close(dynamic.inv_freq, plain)  # type: ignore[attr-defined]
    own = rotary_of(model_dir)
    assert not torch.equal(own.inv_freq, plain)  # type: ignore[attr-defined]


def test_rope_override_is_refused_for_the_transformers_fallback(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "phi"}))
    settings = ShardSettings(model_path=tmp_path, rope_factor=2.0)
    with pytest.raises(StartupRefused, match="phi runs through transformers"):
        read_config(settings)
    assert read_config(ShardSettings(model_path=tmp_path)).raw["model_type"] == "phi"


def test_without_custom_kernels_attention_is_the_reference() -> None:
    off = ShardSettings(model_path=Path("m"), disable_custom_kernels=True)
    plain = probe_capabilities(CUDA, custom_kernels=False)
    assert resolve_attention(off, plain) == "reference"
    if importlib.util.find_spec("triton") is not None:
        on = probe_capabilities(CUDA)
        assert resolve_attention(ShardSettings(model_path=Path("m")), on) == "triton"
    assert resolve_attention(dataclasses.replace(off, attention="reference"), plain) == "reference"
    with pytest.raises(ValueError, match="contradicts --disable-custom-kernels"):
        ShardSettings(model_path=Path("m"), attention="triton", disable_custom_kernels=True)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton installed")
def test_without_custom_kernels_layers_skip_triton() -> None:
    """A CUDA rank (only described here: nothing runs on it) takes the fused kernels unless
    told not to; the CPU never does."""
    assert Dist(0, 1, CUDA, None).caps.triton_kernels
    plain = probe_capabilities(CUDA, custom_kernels=False)
    assert not Dist(0, 1, CUDA, None, plain).caps.triton_kernels
    assert not Dist(0, 1, CPU, None).caps.triton_kernels


def test_without_custom_kernels_gptq_on_cuda_dequantizes() -> None:
    """An 8-bit act-order layer, which int4pack does not take: Triton's on CUDA, else the
    plain-PyTorch dequantize path."""
    layout = int4pack_layout(torch.arange(64, dtype=torch.int32) // 16)
    assert choose_int_kernel(CUDA, torch.float16, 8, 64, layout, True) is IntKernel.TRITON
    assert choose_int_kernel(
        CUDA, torch.float16, 8, 64, layout, True, probe_capabilities(CUDA, custom_kernels=False)
    ) is IntKernel.DEQUANT


def test_engine_built_without_custom_kernels(tiny_model: Callable[..., Path]) -> None:
    engine = load_engine(ShardSettings(model_path=tiny_model("llama"),
                                       disable_custom_kernels=True))
    assert engine.dist.caps.custom_kernels is False
    assert engine.settings.attention == "reference"
    assert load_engine(ShardSettings(model_path=tiny_model("llama"))).dist.caps.custom_kernels

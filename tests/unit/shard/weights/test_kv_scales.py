"""A checkpoint's FP8 KV-cache scales (shard/weights/kv_scales.py): TGI's and vLLM's names under
each attention module, per layer, 1.0 where absent, per-tensor only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pytgi_shard.weights.kv_scales import LayerScales, read_kv_scales


def checkpoint(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    return path


def test_scales_are_read_per_layer_by_their_names(tmp_path: Path) -> None:
    model = checkpoint(tmp_path / "m", {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.5),
        "model.layers.0.self_attn.v_scale": torch.tensor([0.25]),
        # The older single scale, for both.
        "model.layers.1.self_attn.kv_scale": torch.tensor(2.0, dtype=torch.bfloat16),
        # Not KV scales: a weight, an FP8 linear's scales, a layer past the model's.
        "model.layers.0.self_attn.k_proj.weight": torch.zeros(4, 4),
        "model.layers.1.self_attn.k_proj.weight_scale": torch.tensor(3.0),
        "model.layers.3.self_attn.k_scale": torch.tensor(9.0),
        "model.layers.3.self_attn.v_scale": torch.tensor(9.0),
    })  # fmt: skip
    assert read_kv_scales(model, 3) == [
        LayerScales(0.5, 0.25, True), LayerScales(2.0, 2.0, True), LayerScales(1.0, 1.0, False),
    ]


def test_a_lone_k_scale_falls_back_to_kv_scale_then_to_one(tmp_path: Path) -> None:
    model = checkpoint(tmp_path / "m", {
        "transformer.h.0.attn.k_scale": torch.tensor(0.5),
        "transformer.h.0.attn.kv_scale": torch.tensor(0.75),
        "transformer.h.1.attn.k_scale": torch.tensor(0.5),
    })  # fmt: skip
    assert read_kv_scales(model, 2) == [LayerScales(0.75, 0.75, True), LayerScales()]


def test_per_head_scales_are_refused(tmp_path: Path) -> None:
    model = checkpoint(tmp_path / "m", {"model.layers.0.self_attn.k_scale": torch.ones(4)})
    with pytest.raises(ValueError, match="only per-tensor KV cache scales"):
        read_kv_scales(model, 1)

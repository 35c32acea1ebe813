"""Shared fixtures: tiny models in real Hugging Face layout, built once per test session."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors; the variable is read
# when a kernel module is imported, so it must be set before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.tiny_models import build_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """tiny_model("llama" | "mistral" | "qwen2" | "gpt2", sharded=False) -> model directory."""
    root = tmp_path_factory.mktemp("models")
    built: dict[tuple[str, bool], Path] = {}

    def get(family: str = "llama", sharded: bool = False) -> Path:
        key = (family, sharded)
        if key not in built:
            name = f"{family}-sharded" if sharded else family
            built[key] = build_model(root / name, family, shard_size="200KB" if sharded else None)
        return built[key]

    return get

"""Model loading: our tensor-parallel Llama family, or any other causal LM via transformers."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pytgi_shard.attention import get_backend
from pytgi_shard.distributed import Dist
from pytgi_shard.models.llama import Llama
from pytgi_shard.models.llama_config import FAMILY_DEFAULTS
from pytgi_shard.models.model import Model

__all__ = ["Model", "get_model", "read_model_type"]


def read_model_type(model_path: Path) -> str:
    """config.json's model_type, or a ValueError saying why the directory is not a model."""
    config_file = model_path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{model_path} is not a model directory: it has no config.json")
    try:
        model_type = json.loads(config_file.read_text()).get("model_type")
    except (ValueError, AttributeError) as e:
        raise ValueError(f"{config_file} is not a JSON object: {e}") from e
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"{config_file} has no model_type")
    return model_type


def get_model(
    model_path: Path,
    *,
    dtype: torch.dtype,
    dist: Dist,
    trust_remote_code: bool = False,
    attention: str = "reference",
) -> Model:
    """Loads the model at `model_path` for this rank.

    llama, mistral and qwen2 run on our tensor-parallel implementation; anything else runs
    through transformers on a single shard.
    """
    model_type = read_model_type(model_path)
    backend = get_backend(attention)
    if model_type in FAMILY_DEFAULTS:
        return Llama.load(model_path, dtype, dist, backend)
    # Imported only when needed: transformers takes seconds to import.
    from pytgi_shard.models.transformers_model import TransformersModel

    return TransformersModel.load(model_path, dtype, dist, backend, trust_remote_code)

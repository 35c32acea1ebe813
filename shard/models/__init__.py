"""Model loading: our tensor-parallel Llama family, or any other causal LM via transformers.

Loading is safe by default: safetensors only (no pickle is ever opened), a model that needs
its own Python code (config.json `auto_map`) is refused unless --trust-remote-code asks for it,
and a quantized checkpoint is refused (no quantized kernels yet), naming its method.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from pytgi_shard.attention.backend import get_backend
from pytgi_shard.distributed import Dist
from pytgi_shard.models.llama import Llama
from pytgi_shard.models.llama_config import FAMILY_DEFAULTS
from pytgi_shard.models.model import Model
from pytgi_shard.models.model_config import ModelConfig
from pytgi_shard.models.quantization import check_not_quantized
from pytgi_shard.weights import find_weight_files

__all__ = ["Model", "ModelConfig", "get_model"]

log = logging.getLogger(__name__)


def check_remote_code(
    model_path: Path, config: Mapping[str, Any], trust_remote_code: bool
) -> None:
    """Refuses a model whose loading would import Python files shipped with it, unless asked.
    A model type transformers knows loads with its own classes (auto_map is then ignored)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    auto_map = config.get("auto_map")
    if not auto_map or trust_remote_code or config.get("model_type") in CONFIG_MAPPING:
        return
    names = auto_map.values() if isinstance(auto_map, dict) else [auto_map]
    classes = ", ".join(sorted(str(name) for name in names))
    raise ValueError(
        f"{model_path} needs its own Python code to load ({classes}, named by config.json "
        "`auto_map`), which runs with the shard's permissions: pass --trust-remote-code only if "
        "you trust its authors"
    )


def get_model(
    config: ModelConfig,
    *,
    dtype: torch.dtype,
    dist: Dist,
    trust_remote_code: bool = False,
    attention: str = "reference",
) -> Model:
    """Loads the model of `config` (its directory's config.json, read once) for this rank.

    llama, mistral and qwen2 run on our tensor-parallel implementation; anything else runs
    through transformers on a single shard.
    """
    model_path, model_type = config.path, config.model_type
    check_not_quantized(model_path, config.raw)
    find_weight_files(model_path)  # safetensors or a clear refusal, before anything loads
    backend = get_backend(attention)
    if model_type in FAMILY_DEFAULTS:
        if config.raw.get("auto_map"):
            log.warning("%s names custom code (auto_map): not run, %s is served by pytgi's own "
                        "implementation", model_path, model_type)
        return Llama.load(config, dtype, dist, backend)
    # Imported only when needed: transformers takes seconds to import.
    check_remote_code(model_path, config.raw, trust_remote_code)
    from pytgi_shard.models.transformers_model import TransformersModel

    return TransformersModel.load(model_path, dtype, dist, backend, trust_remote_code)

"""Model loading: the registry of pytgi's own tensor-parallel models, or any other causal LM via
transformers on one shard.

MODELS maps config.json's model_type to the loader of its implementation; adding an
architecture is one model file or decoder configuration (llama_config.py), one line here and one
test entry. Anything not in the table runs through transformers, which cannot shard.

Loading is safe by default: safetensors only (no pickle is ever opened), and a model that
needs its own Python code (config.json `auto_map`) is refused unless --trust-remote-code asks
for it. Quantization (a pre-quantized checkpoint, or --quantize) is resolved before anything
loads and refused, in one line, for a family or method pytgi cannot serve it with
(models/quantization.py).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from pytgi_shard.attention.backend import get_backend
from pytgi_shard.device.distributed import Dist
from pytgi_shard.models.bloom import Bloom
from pytgi_shard.models.falcon import Falcon
from pytgi_shard.models.gpt2 import GPT2
from pytgi_shard.models.gpt_neox import GPTNeoX
from pytgi_shard.models.llama.cohere import cohere_config
from pytgi_shard.models.llama.gemma import gemma2_config, gemma3_text_config, gemma_config
from pytgi_shard.models.llama.granite import granite_config
from pytgi_shard.models.llama.model import Llama, ModelLoader
from pytgi_shard.models.llama.moe import mixtral_config, qwen2_moe_config, qwen3_moe_config
from pytgi_shard.models.llama.phi3 import phi3_config
from pytgi_shard.models.llama.starcoder2 import starcoder2_config
from pytgi_shard.models.model import Model
from pytgi_shard.models.model_config import ModelConfig
from pytgi_shard.models.mpt import MPT
from pytgi_shard.models.opt import OPT
from pytgi_shard.models.quantized_families import check_model_family, log_linear_kernels
from pytgi_shard.models.t5 import T5
from pytgi_shard.models.vision_families import VISION_FAMILIES
from pytgi_shard.quantization.detection import detect_quantization
from pytgi_shard.quantization.kernel_table import linear_format
from pytgi_shard.quantization.spec import QuantizationSpec
from pytgi_shard.weights.reader import find_weight_files

__all__ = ["MODELS", "Model", "ModelConfig", "get_model"]

log = logging.getLogger(__name__)

# model_type -> the loader of pytgi's own, tensor-parallel implementation.
MODELS: Mapping[str, ModelLoader] = MappingProxyType({
    "llama": Llama.load,
    "mistral": Llama.load,
    "qwen2": Llama.load,
    "qwen3": Llama.load,
    **VISION_FAMILIES,
    "gemma": Llama.loader(gemma_config),
    "gemma2": Llama.loader(gemma2_config),
    "gemma3_text": Llama.loader(gemma3_text_config),
    "phi3": Llama.loader(phi3_config),
    "starcoder2": Llama.loader(starcoder2_config),
    "granite": Llama.loader(granite_config),
    "cohere": Llama.loader(cohere_config),
    "mixtral": Llama.loader(mixtral_config),
    "qwen2_moe": Llama.loader(qwen2_moe_config),
    "qwen3_moe": Llama.loader(qwen3_moe_config),
    "gpt2": GPT2.load,
    "gpt_bigcode": GPT2.load,
    "gpt_neox": GPTNeoX.load,
    "falcon": Falcon.load,
    "opt": OPT.load,
    "bloom": Bloom.load,
    "mpt": MPT.load,
    "t5": T5.load,
    "mt5": T5.load,
})


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
    quantization: QuantizationSpec | None = None,
) -> Model:
    """Loads the model of `config` (its directory's config.json, read once) for this rank.

    A model_type in MODELS runs on pytgi's own tensor-parallel implementation; anything else
    runs through transformers on a single shard. `quantization`: what resolve_quantization gave
    for --quantize; None means no flag, the checkpoint's own (detected here).
    """
    model_path, model_type = config.path, config.model_type
    if quantization is None:
        quantization = detect_quantization(model_path, config.raw)
    check_model_family(model_type, quantization, MODELS.keys())
    linear_format(quantization)  # a method without a kernel in this build: refused before loading
    find_weight_files(model_path)  # safetensors or a clear refusal, before anything loads
    backend = get_backend(attention)
    loader = MODELS.get(model_type)
    if loader is not None:
        if config.raw.get("auto_map"):
            log.warning("%s names custom code (auto_map): not run, %s is served by pytgi's own "
                        "implementation", model_path, model_type)
        model = loader(dataclasses.replace(config, quantization=quantization), dtype, dist,
                       backend)
        log_linear_kernels(model, model_type, quantization)
        return model
    if dist.world_size > 1:
        raise ValueError(
            f"Sharded {model_type} is not supported: only pytgi's own implementations shard "
            f"({', '.join(sorted(MODELS))}); use --num-shard 1"
        )
    # Imported only when needed: transformers takes seconds to import.
    check_remote_code(model_path, config.raw, trust_remote_code)
    from pytgi_shard.models.transformers_model import TransformersModel

    return TransformersModel.load(model_path, dtype, dist, backend, trust_remote_code)

"""A checkpoint's config.json, read once at start-up and handed to whatever needs it.

Start-up reads it once (shard/service/startup.py) and passes this object on: the dtype choice, the model
loader (family, remote code, quantization, the Llama configuration) and the tokenizer's EOS
fallback all see the same reading, and the file is never reopened.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from pytgi_shard.models.config_layout import legacy_layout
from pytgi_shard.quantization.spec import QuantizationSpec


@dataclass(frozen=True)
class ModelConfig:
    # The model directory the file was read from (error messages, weights, tokenizer).
    path: Path
    # config.json's top-level object, read-only, with transformers 5's renamed keys also under
    # their transformers 4 names (config_layout.py), which the family readers read.
    raw: Mapping[str, Any]
    # How the linear weights are stored or quantized, as get_model resolved it (None: float);
    # the model's Weights read the checkpoint with it (decoder_model.with_weights).
    quantization: QuantizationSpec | None = None

    @classmethod
    def read(cls, model_path: Path) -> ModelConfig:
        """config.json of `model_path`, or a ValueError saying why the directory is not a model."""
        config_file = model_path / "config.json"
        if not config_file.is_file():
            raise ValueError(f"{model_path} is not a model directory: it has no config.json")
        try:
            config = json.loads(config_file.read_text())
        except ValueError as e:
            raise ValueError(f"{config_file} is not a JSON object: {e}") from e
        if not isinstance(config, dict):
            raise ValueError(f"{config_file} is not a JSON object")
        return cls(model_path, MappingProxyType(legacy_layout(config)))

    @property
    def model_type(self) -> str:
        """config.json's model_type, or a ValueError saying why the directory is not a model."""
        model_type = self.raw.get("model_type")
        if not isinstance(model_type, str) or not model_type:
            raise ValueError(f"{self.path / 'config.json'} has no model_type")
        return model_type

    def with_rope_scaling(self, scaling: Mapping[str, Any]) -> ModelConfig:
        """This config with `rope_scaling` replaced (TGI's --rope-scaling/--rope-factor): done
        once at start-up, so every family's reader sees the operator's scaling as if the file
        said it."""
        raw = {**self.raw, "rope_scaling": dict(scaling)}
        return dataclasses.replace(self, raw=MappingProxyType(raw))

"""Issue 11 item 8: a quantized checkpoint is refused at start-up, naming its method, instead of
loading silently wrong (FP8 weights cast, scales ignored) or failing cryptically (GPTQ/AWQ)."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pytgi_shard.distributed import single_process
from pytgi_shard.models import ModelConfig, get_model
from pytgi_shard.models.quantization import quantization_method
from tests.shard_process import shard_command

CONFIGS: list[tuple[dict[str, Any], str]] = [
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "fp8"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "gptq"),
    ({"quant_method": "awq", "bits": 4, "version": "gemm"}, "awq"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "compressed-tensors"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
    ({"load_in_8bit": True}, "bitsandbytes"),
    ({"bits": 4}, "unknown method"),
]


def quantized_copy(model: Path, dest: Path, quantization: dict[str, Any]) -> Path:
    shutil.copytree(model, dest)
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"] = quantization
    (dest / "config.json").write_text(json.dumps(config))
    return dest


@pytest.mark.parametrize(("quantization", "method"), CONFIGS)
def test_the_method_is_named(quantization: dict[str, Any], method: str) -> None:
    assert quantization_method(quantization) == method


@pytest.mark.parametrize("family", ["llama", "gpt2"])  # our Llama and the transformers fallback
@pytest.mark.parametrize(("quantization", "method"), CONFIGS[:3])
def test_get_model_refuses_a_quantization_config(
    tiny_model: Callable[..., Path], tmp_path: Path, family: str,
    quantization: dict[str, Any], method: str,
) -> None:
    path = quantized_copy(tiny_model(family), tmp_path / "q", quantization)
    with pytest.raises(ValueError, match=rf"quantized checkpoint \({method}, declared by "
                                         r"config.json `quantization_config`\)"):
        get_model(ModelConfig.read(path), dtype=torch.float32, dist=single_process(torch.device("cpu")))


def test_an_old_gptq_side_file_is_refused(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    path = tmp_path / "q"
    shutil.copytree(tiny_model("llama"), path)
    (path / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 128}))
    with pytest.raises(ValueError, match=r"\(gptq, declared by quantize_config.json\)"):
        get_model(ModelConfig.read(path), dtype=torch.float32, dist=single_process(torch.device("cpu")))


def test_the_shard_refuses_to_start(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    path = quantized_copy(tiny_model("llama"), tmp_path / "fp8", CONFIGS[0][0])
    refused = subprocess.run(
        [*shard_command(), "serve", str(path), "--uds-path", str(tmp_path / "s")],
        capture_output=True, text=True, timeout=120,
    )
    assert refused.returncode != 0
    assert "is a quantized checkpoint (fp8" in refused.stdout + refused.stderr

"""Issue 17: quantization refused at start-up, in one line, by get_model, by the shard process
(no traceback: the launcher shows its last lines) and by the launcher before it spawns anything;
and the one-line log of what runs."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pytgi_launcher.launch import quantization_in_use
from pytgi_shard.device.distributed import single_process
from pytgi_shard.models import ModelConfig, get_model
from pytgi_shard.models.quantized_families import log_linear_kernels
from pytgi_shard.quantization.errors import QuantizationError
from pytgi_shard.quantization.spec import QuantizationSpec
from tests.shard_process import shard_command
from tests.unit.shard.quantized_double import RowInt8

CPU = torch.device("cpu")
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128}


def quantized_copy(model: Path, dest: Path, quantization: dict[str, Any]) -> Path:
    shutil.copytree(model, dest)
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"] = quantization
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def load(path: Path) -> None:
    get_model(ModelConfig.read(path), dtype=torch.float32, dist=single_process(CPU))


@pytest.mark.parametrize(("family", "refusal"), [
    ("phi3", "gptq checkpoints of phi3 are not supported: its linear layers are stored fused"),
    ("gpt2", "gptq checkpoints of gpt2 are not supported"),
    ("phi", "phi runs through the transformers fallback, which pytgi does not quantize"),
])  # fmt: skip
def test_get_model_refuses_families_that_cannot_read_a_checkpoint(
    tiny_model: Callable[..., Path], tmp_path: Path, family: str, refusal: str
) -> None:
    path = quantized_copy(tiny_model(family), tmp_path / "q", GPTQ)
    with pytest.raises(QuantizationError, match=refusal):
        load(path)


def test_refused_formats_fail_before_any_weight_is_read(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    path = quantized_copy(tiny_model("llama"), tmp_path / "q", {"quant_method": "aqlm"})
    with pytest.raises(QuantizationError, match="aqlm checkpoints .* are not supported"):
        load(path)
    (path / "config.json").write_text(json.dumps(json.loads(
        (tiny_model("llama") / "config.json").read_text())))
    (path / "quantize_config.json").write_text(json.dumps({"bits": 3, "group_size": 128}))
    with pytest.raises(QuantizationError, match=r"gptq 3-bit \(declared by quantize_config.json\)"):
        load(path)


def test_a_model_no_linear_of_which_was_quantized_is_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A family that builds its layers past the LinearFormat must not pass as quantized."""
    eetq = QuantizationSpec("eetq", False, "--quantize")
    with pytest.raises(QuantizationError, match="eetq did not apply to any linear layer of t5"):
        log_linear_kernels(torch.nn.Linear(4, 4), "t5", eetq)
    model = torch.nn.ModuleList([RowInt8.from_float(torch.randn(4, 4)) for _ in range(3)])
    with caplog.at_level(logging.INFO):
        log_linear_kernels(model, "llama", eetq)
    assert "quantization eetq (quantized on load, declared by --quantize): linear layers 3 on " \
        "RowInt8" in caplog.text


def run_shard(path: Path, tmp_path: Path, *args: str, env: dict[str, str] | None = None
              ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*shard_command(), "serve", str(path), "--uds-path", str(tmp_path / "s"), *args],
        capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})},
    )


def test_the_shard_refuses_to_start_in_one_line(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    refused = run_shard(tiny_model("llama"), tmp_path, "--quantize", "gptq")
    out = refused.stdout + refused.stderr
    assert refused.returncode == 1
    assert "shard 0 cannot start: --quantize gptq needs a gptq checkpoint" in out
    assert "Traceback" not in out
    bad = run_shard(tiny_model("llama"), tmp_path, env={"QUANTIZE": "int3"})
    assert bad.returncode == 2
    assert "QUANTIZE: unknown quantization 'int3'; valid values: awq, compressed-tensors" in \
        bad.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_launcher_refuses_before_spawning_anything(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    path = quantized_copy(tiny_model("llama"), tmp_path / "q", GPTQ)
    launcher = [sys.executable, "-m", "pytgi_launcher.cli", "--model-id", str(path),
                "--port", str(free_port()), "--hostname", "127.0.0.1"]
    refused = subprocess.run([*launcher, "--quantize", "eetq"], capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode == 1
    assert refused.stderr.strip().splitlines()[-1] == (
        f"pytgi-launcher: error: --quantize eetq contradicts the checkpoint at {path}, which is "
        "gptq (declared by config.json `quantization_config`); pre-quantized checkpoints are "
        "detected: leave --quantize out"
    )
    assert "started shard" not in refused.stdout + refused.stderr
    bad = subprocess.run(launcher, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "QUANTIZE": "exl2"})
    assert bad.returncode == 2
    assert "QUANTIZE='exl2' is not valid for --quantize: --quantize exl2 (ExLlamaV2 " \
        "checkpoints) is not supported by pytgi" in bad.stderr


def test_the_launcher_says_what_runs(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    float_model = tiny_model("llama")
    assert quantization_in_use(float_model, None) == "no quantization"
    assert quantization_in_use(float_model, "bitsandbytes-nf4") == (
        "quantization bitsandbytes-nf4 (quantized on load, declared by --quantize)")
    path = quantized_copy(float_model, tmp_path / "q", {**GPTQ, "desc_act": True})
    assert quantization_in_use(path, None) == (
        "quantization gptq 4-bit, group size 128, act-order, symmetric, format gptq "
        "(pre-quantized, declared by config.json `quantization_config`)")

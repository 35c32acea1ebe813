"""`pytgi-shard serve` on a checkpoint of pickled `.bin` weights refuses to start, says why and
how to convert them; after `pytgi-shard download-weights` (weights-only conversion) it loads."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from pytgi_shard.device.distributed import single_process
from pytgi_shard.models import ModelConfig, get_model
from tests.shard_process import shard_command


def test_pickled_weights_are_refused_until_converted(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    path = tmp_path / "llama-bin"
    shutil.copytree(tiny_model("llama"), path)
    torch.save(load_file(path / "model.safetensors"), path / "pytorch_model.bin")
    (path / "model.safetensors").unlink()
    refused = subprocess.run(
        [*shard_command(), "serve", str(path), "--uds-path", str(tmp_path / "s")],
        capture_output=True, text=True, timeout=120,
    )
    assert refused.returncode == 1
    output = refused.stdout + refused.stderr
    assert "holds only pickled PyTorch weights (pytorch_model.bin)" in output
    assert f"`pytgi-shard download-weights {path}`" in output
    converted = subprocess.run([*shard_command(), "download-weights", str(path)],
                               capture_output=True, text=True, timeout=120)
    assert converted.returncode == 0, converted.stderr
    assert (path / "model.safetensors").is_file()
    model = get_model(ModelConfig.read(path), dtype=torch.float32, dist=single_process(torch.device("cpu")))
    assert model.model_type == "llama"

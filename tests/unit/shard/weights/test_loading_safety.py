"""Loading is safe by default: no pickle is ever opened (a `.bin`-only checkpoint is refused with
the way out), and a model that needs its own Python code loads only with trust_remote_code."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pytgi_shard.device.distributed import single_process
from pytgi_shard.models import ModelConfig, get_model

CPU = torch.device("cpu")


class _Exploit:
    """Runs a command when unpickled: what a hostile `.bin` does to whoever opens it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, ...]]:
        return (os.system, (f"touch {self.marker}",))


def pickled_copy(model: Path, dest: Path) -> Path:
    """`model` with its safetensors replaced by a pickled state dict carrying an exploit."""
    shutil.copytree(model, dest)
    state: dict[str, object] = dict(load_file(dest / "model.safetensors"))
    state["payload"] = _Exploit(dest / "PWNED")
    (dest / "model.safetensors").unlink()
    torch.save(state, dest / "pytorch_model.bin", pickle_module=pickle)
    return dest


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_pickle_only_checkpoint_is_refused_unopened(
    tiny_model: Callable[..., Path], tmp_path: Path, family: str
) -> None:
    path = pickled_copy(tiny_model(family), tmp_path / family)
    with pytest.raises(ValueError, match="holds only pickled PyTorch weights") as refused:
        get_model(ModelConfig.read(path), dtype=torch.float32, dist=single_process(CPU))
    assert f"pytgi-shard download-weights {path}" in str(refused.value)
    assert not (path / "PWNED").exists(), "the pickle was opened"


CUSTOM_CODE = '''
from pathlib import Path
from transformers import GPT2Config, GPT2LMHeadModel

Path({marker!r}).touch()


class CustomConfig(GPT2Config):
    model_type = "pytgi_custom"


class CustomModel(GPT2LMHeadModel):
    config_class = CustomConfig
'''


@pytest.fixture
def custom_model(
    tiny_model: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """The tiny GPT-2 under a model type only its own `custom.py` defines."""
    path = tmp_path / "custom"
    shutil.copytree(tiny_model("gpt2"), path)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="pytgi_custom", architectures=["CustomModel"],
                  auto_map={"AutoConfig": "custom.CustomConfig",
                            "AutoModelForCausalLM": "custom.CustomModel"})
    (path / "config.json").write_text(json.dumps(config))
    (path / "custom.py").write_text(CUSTOM_CODE.format(marker=str(tmp_path / "RAN")))
    # transformers copies remote code into its modules cache: keep it in this test's folder.
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    return path


def test_custom_code_runs_only_with_trust_remote_code(custom_model: Path) -> None:
    marker = custom_model.parent / "RAN"
    with pytest.raises(ValueError, match="pass --trust-remote-code only if you trust") as refused:
        get_model(ModelConfig.read(custom_model), dtype=torch.float32, dist=single_process(CPU))
    assert "custom.CustomModel" in str(refused.value)
    assert not marker.exists(), "the model's code ran without trust_remote_code"
    model = get_model(ModelConfig.read(custom_model), dtype=torch.float32, dist=single_process(CPU),
                      trust_remote_code=True)
    assert marker.exists() and model.model_type == "pytgi_custom"


def test_custom_code_of_a_native_family_is_never_run(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    path = tmp_path / "llama"
    shutil.copytree(tiny_model("llama"), path)
    config = json.loads((path / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "custom.Anything"}
    (path / "config.json").write_text(json.dumps(config))
    (path / "custom.py").write_text(f"open({str(tmp_path / 'RAN')!r}, 'w')\n")
    model = get_model(ModelConfig.read(path), dtype=torch.float32, dist=single_process(CPU), trust_remote_code=True)
    assert model.model_type == "llama" and not (tmp_path / "RAN").exists()

"""--lora-adapters: TGI's syntax, and every adapter that does not fit refused at start-up in one
line naming it and the reason."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pytgi_shard.lora.spec import AdapterSpec, parse_lora_adapters
from pytgi_shard.service.startup import StartupRefused, load_engine
from pytgi_shard.settings import ShardSettings
from tests.lora_adapters import write_adapter


def test_the_syntax_is_tgis() -> None:
    assert parse_lora_adapters("org/sql, chat=org/chat-lora,local=/data/a") == (
        AdapterSpec("org/sql", "org/sql"), AdapterSpec("chat", "org/chat-lora"),
        AdapterSpec("local", "/data/a"))
    assert parse_lora_adapters(None) == parse_lora_adapters(" ") == ()
    for bad, why in (("a,,b", "empty item"), ("a=x,a=y", "twice"), ("=x", "expected")):
        with pytest.raises(ValueError, match=why):
            parse_lora_adapters(bad)


def refusal(model: Path, spec: str) -> str:
    with pytest.raises(StartupRefused) as info:
        load_engine(ShardSettings(model_path=model, lora_adapters=spec))
    message = str(info.value)
    assert "\n" not in message
    return message


def test_adapters_that_do_not_fit_are_refused_naming_them(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    llama = tiny_model("llama")
    big = write_adapter(tmp_path / "big", llama, rank=65, alpha=8)
    assert "'big': rank r=65 is not in 1..64" in refusal(llama, f"big={big}")
    good = write_adapter(tmp_path / "good", llama, rank=4, alpha=8)
    # An adapter trained for another base model: its shapes differ.
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    tensors = load_file(str(good / "adapter_model.safetensors"))
    save_file({k: torch.cat([v, v], dim=1) if "lora_A" in k else v for k, v in tensors.items()},
              str(wrong / "adapter_model.safetensors"))
    assert "'wrong': layer 0 q_proj is 64×128, the base model's is 64×64" in refusal(
        llama, f"wrong={wrong}")
    # A module pytgi does not adapt (embeddings).
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    save_file({"base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(4, 8)},
              str(odd / "adapter_model.safetensors"))
    assert "'odd': tensor base_model.model.model.embed_tokens" in refusal(llama, f"odd={odd}")
    assert "'missing': directory ./nowhere does not exist" in refusal(llama, "missing=./nowhere")


def test_a_model_without_lora_support_is_refused(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    gpt2 = tiny_model("gpt2")
    adapter = write_adapter(tmp_path / "a", tiny_model("llama"), rank=4, alpha=8)
    message = refusal(gpt2, f"a={adapter}")
    assert "LoRA adapter 'a'" in message and "Llama-family models only" in message

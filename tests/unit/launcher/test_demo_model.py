"""The bundled demo model: complete HF folder, small, shipped as package data, and a real
language model of Shakespeare (held-out verse is far likelier to it than the same words shuffled)."""

from __future__ import annotations

import fnmatch
import json
import random
from pathlib import Path

import pytest
import tomllib
import torch

from pytgi_launcher.settings import DEMO_MODEL
from pytgi_shard.service.cli import build_parser
from pytgi_shard.weights.download import source_from_args

ROOT = Path(__file__).resolve().parents[3]
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "generation_config.json")
# The closing lines of Hamlet: the end of every play is in the held-out split (train.py).
HELD_OUT = """Let four captains
Bear Hamlet like a soldier to the stage;
For he was likely, had he been put on,
To have prov'd most royally: and, for his passage,
The soldiers' music and the rites of war
Speak loudly for him.--
Take up the bodies.--Such a sight as this
Becomes the field, but here shows much amiss.
Go, bid the soldiers shoot.
"""


def test_folder_is_complete_and_small() -> None:
    for name in FILES:
        assert (DEMO_MODEL / name).is_file(), name
    size = sum(p.stat().st_size for p in DEMO_MODEL.iterdir() if p.is_file())
    assert size < 25 * 2**20


def test_download_weights_defaults_to_the_launchers_demo_model() -> None:
    # The shard finds the folder without importing the launcher; both must name the same one.
    args = build_parser().parse_args(["download-weights"])
    assert source_from_args(args, {}).model_id == str(DEMO_MODEL)
    assert source_from_args(build_parser().parse_args(["download-weights", "x/y"]), {}).model_id == "x/y"


def test_files_ship_as_package_data() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    globs = setuptools["package-data"]["pytgi_launcher"]
    assert setuptools["package-dir"]["pytgi_launcher"] == "launcher"
    for name in FILES:
        assert any(fnmatch.fnmatch(f"demo_model/{name}", g) for g in globs), name


def test_is_a_llama_that_two_shards_can_split() -> None:
    config = json.loads((DEMO_MODEL / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        assert config[key] % 2 == 0, key
    assert config["hidden_size"] // config["num_attention_heads"] == 64


def mean_nll(model: torch.nn.Module, ids: list[int]) -> float:
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=x).logits[0, :-1].float()
    return float(torch.nn.functional.cross_entropy(logits, x[0, 1:]))


@pytest.mark.timeout(120)
def test_prefers_shakespeare_to_the_same_words_shuffled() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL).eval()
    words = HELD_OUT.split(" ")
    random.Random(0).shuffle(words)
    real = mean_nll(model, tok(HELD_OUT).input_ids)
    shuffled = mean_nll(model, tok(" ".join(words)).input_ids)
    uniform = torch.log(torch.tensor(float(len(tok)))).item()
    assert real < shuffled - 0.5, (real, shuffled)
    assert real < uniform - 2.5, (real, uniform)

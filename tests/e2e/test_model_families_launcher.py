"""`pytgi-launcher --model-id <dir> --num-shard 2` serves the new architectures: shards and router
started by the launcher, a real HTTP client, greedy tokens equal transformers' `generate`.

Every registered architecture, as the issue asks (`tests/integration/test_model_families_serving.py`
serves each over gRPC on 1 and 2 ranks through the router's core; this is the user's path).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from text_generation import Client
from tokenizers import Tokenizer

from pytgi_shard.models import MODELS
from tests.hf_reference import hf_greedy
from tests.integration.test_model_families_serving import MAX_NEW, STD, TEXTS, same_greedy
from tests.launcher_process import Launcher
from tests.tiny_models import EOS, build_model


@pytest.mark.parametrize("family", sorted(MODELS))
def test_launcher_serves_family_on_two_shards(tmp_path: Path, family: str) -> None:
    path = build_model(tmp_path / family, family, std=STD)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    prompt = TEXTS[0]
    expected = hf_greedy(path, tokenizer.encode(prompt).ids, MAX_NEW)[0]
    launcher = Launcher("--model-id", str(path), "--num-shard", "2")
    try:
        launcher.wait_ready()
        response = Client(launcher.url, timeout=60).generate(
            prompt, max_new_tokens=MAX_NEW, do_sample=False, stop_sequences=[]
        )
    finally:
        launcher.close()
    got = [t.id for t in response.details.tokens]
    # The router stops at EOS as generate does; same_greedy wants all MAX_NEW tokens otherwise.
    if len(expected) < MAX_NEW:
        assert got == expected
    else:
        assert same_greedy(got, expected, tokenizer.token_to_id(EOS)), (family, got, expected)

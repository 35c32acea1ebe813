"""`pytgi-launcher --model-id <dir> --num-shard 2` serves every registered architecture: shards
and router started by the launcher, a real HTTP client, greedy tokens equal to transformers'
`generate` and their logprobs within 1e-3 (float32).

This is also the registry's two-rank serving proof: the two prompts of
tests/integration/test_model_families_serving.py (one across three KV blocks and longer than any
family's sliding window, one shorter that still crosses a block boundary) are sent at once, so
the second is batched with the first (in its prefill, or joining its decode), on two
`pytgi-shard serve` ranks over gRPC, weights sliced per rank at load. That file serves each
architecture on one rank through the router's core; the launcher's path includes it (the router
drives the same Infer), so a separate two-rank gRPC run per architecture proved nothing more.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer

from pytgi_shard.models import MODELS
from tests.integration.test_model_families_serving import MAX_NEW, TEXTS, case_of, same_greedy
from tests.launcher_process import Launcher
from tests.tiny_models import EOS
from tests.vision_models import VISION_FAMILIES


def served(url: str, text: str) -> tuple[list[int], list[float]]:
    """Greedy tokens of `text` over HTTP (EOS ignored, as the gRPC test) and their logprobs."""
    response = httpx.post(f"{url}/generate", timeout=60, json={"inputs": text, "parameters": {
        "max_new_tokens": MAX_NEW, "details": True, "ignore_eos": True}})  # fmt: skip
    response.raise_for_status()
    tokens = response.json()["details"]["tokens"]
    return [t["id"] for t in tokens], [t["logprob"] for t in tokens]


@pytest.mark.parametrize(
    "family", sorted(set(MODELS) - set(VISION_FAMILIES))  # VLMs: test_qwen2_vl_serving.py
)
def test_launcher_serves_family_on_two_shards(tmp_path: Path, family: str) -> None:
    path, _, expected = case_of(family, tmp_path)
    eos = Tokenizer.from_file(str(path / "tokenizer.json")).token_to_id(EOS)
    launcher = Launcher("--model-id", str(path), "--num-shard", "2")
    try:
        launcher.wait_ready()
        with ThreadPoolExecutor(len(TEXTS)) as pool:
            got = list(pool.map(lambda text: served(launcher.url, text), TEXTS))
    finally:
        launcher.close()
    for (tokens, logprobs), (want, want_logprobs) in zip(got, expected, strict=True):
        assert same_greedy(tokens, want, eos), (family, tokens, want)
        shared = len(want_logprobs)
        assert logprobs[:shared] == pytest.approx(want_logprobs, abs=1e-3), family

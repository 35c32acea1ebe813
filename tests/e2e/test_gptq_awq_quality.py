"""Issue 17's quality proof for pre-quantized checkpoints: the trained demo model
(launcher/demo_model) exported as GPTQ (v1, act-order, asymmetric) and as AWQ (GEMM), 4 bits in
groups of 32, served by `pytgi-launcher` (the format detected from config.json, no flag); the
perplexity of the held-out Shakespeare (tests/e2e/test_quantization_quality.py says which text)
from the prompt logprobs it serves is within 1% of transformers' on the export's own dequantized
float copy, over the very token ids the server read. What differs is only how the weights are
multiplied (PyTorch's int4 kernel, activations in bfloat16), not what they are.
"""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import pytest
import torch
from tokenizers import Tokenizer

from tests.e2e.test_quantization_quality import (
    CHUNK_TOKENS,
    TEXT,
    TOKENIZER,
    chunks,
    served_prompts,
)
from tests.int_quantized_checkpoints import write_quantized_llama
from tests.launcher_process import Launcher

DEMO_MODEL = TOKENIZER.parent
# (method, checkpoint format, act-order, symmetric)
EXPORTS = [("gptq", "gptq", True, False), ("awq", "gemm", False, False)]
BOUND = 0.01


def transformers_nll(model_dir: Path, prompts: list[list[int]]) -> float:
    """-sum log p of each prompt's ids[1:] under transformers' model of `model_dir` (loaded
    once), given the ones before, each prompt on its own."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total = 0.0
    with torch.no_grad():
        for ids in prompts:
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
            total -= float(logprobs.gather(1, torch.tensor(ids[1:])[:, None]).sum())
    return total


@pytest.mark.parametrize(("method", "fmt", "act_order", "sym"), EXPORTS)
def test_served_perplexity_equals_transformers_on_the_dequantized_copy(
    tmp_path: Path, method: str, fmt: str, act_order: bool, sym: bool
) -> None:
    quantized, dequantized = tmp_path / method, tmp_path / f"{method}-float"
    write_quantized_llama(DEMO_MODEL, quantized, dequantized, method, fmt, act_order, sym, 32)
    texts = chunks(TEXT.read_text(), Tokenizer.from_file(str(TOKENIZER)), CHUNK_TOKENS)
    launcher = Launcher("--model-id", str(quantized))
    try:
        launcher.wait_ready()
        assert httpx.get(f"{launcher.url}/info", timeout=30).json().get("quantize") == method
        served = served_prompts(launcher.url, texts)
        assert "Int4PackWeight" in launcher.output  # the shard's kernel line
    finally:
        launcher.close()
    count = sum(len(logprobs) for _, logprobs in served)
    assert count > 1800
    ours = math.exp(-sum(sum(logprobs) for _, logprobs in served) / count)
    reference = math.exp(transformers_nll(dequantized, [ids for ids, _ in served]) / count)
    change = ours / reference - 1
    print(f"{method}: served perplexity {ours:.3f}, transformers on the float copy "
          f"{reference:.3f} ({change:+.3%})")  # fmt: skip
    assert abs(change) <= BOUND, f"{method}: {change:+.3%}"

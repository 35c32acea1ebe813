"""Issue 17 end to end through `pytgi-launcher --num-shard 2`: a GPTQ checkpoint (act-order, v1,
asymmetric) is detected without a flag, the launcher and the shards log which quantization and
which kernels run, /info reports it, and the served greedy tokens and logprobs are those of
transformers on the checkpoint's own dequantized float copy (logprobs to bfloat16 precision: the
int4 kernel computes in it). A shard split that would cut a
quantization group stops the launch with the shard's one-line reason naming the --num-shard
values that work. A compressed-tensors FP8 checkpoint serves exactly its dequantized copy, and
QUANTIZE=eetq quantizes a float checkpoint on load."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from text_generation import Client
from text_generation.types import Response

from tests.e2e.test_launcher import transformers_greedy
from tests.fp8_checkpoints import write_fp8_checkpoint
from tests.gptq_checkpoints import write_gptq_checkpoint
from tests.launcher_process import START_TIMEOUT, Launcher

PROMPT = "To be, or not to be"


def transformers_logprobs(model_dir: Path, ids: list[int], prompt: str) -> list[float]:
    """log p(ids[i] | prompt, ids[:i]) under transformers on `model_dir`, float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype="float32")
    prompt_ids = tok(prompt, return_tensors="pt").input_ids[0].tolist()
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    start = len(prompt_ids) - 1
    return [float(logprobs[start + i, token]) for i, token in enumerate(ids)]


def serve_greedy(launcher: Launcher, max_new_tokens: int) -> tuple[dict[str, Any], Response]:
    """`launcher`'s /info and its greedy generation from PROMPT; the launcher is closed after
    (its output stays readable)."""
    try:
        launcher.wait_ready()
        info = httpx.get(f"{launcher.url}/info", timeout=30).json()
        response = Client(launcher.url, timeout=60).generate(
            PROMPT, max_new_tokens=max_new_tokens, do_sample=False
        )
    finally:
        launcher.close()
    return info, response


def test_a_gptq_checkpoint_is_served_sharded(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    gptq, oracle = write_gptq_checkpoint(tiny_model("llama"), tmp_path)
    launcher = Launcher("--model-id", str(gptq), "--num-shard", "2")
    info, response = serve_greedy(launcher, 10)
    out = launcher.output
    assert "quantization gptq 4-bit, group size 32, act-order, asymmetric, format gptq " \
        "(pre-quantized, declared by config.json `quantization_config`)" in out
    for rank in range(2):  # each shard: its 2 layers x (qkv, o, gate_up, down), named kernels
        line = next(x for x in launcher.lines if x.startswith(f"[shard-{rank}]")
                    and "linear layers" in x)
        counts = re.findall(r"(\d+) on \w+Weight", line.split("linear layers", 1)[1])
        assert sum(int(c) for c in counts) == 8, line
    assert info["quantize"] == "gptq"
    ids, text = transformers_greedy(oracle, PROMPT, 10)
    assert [t.id for t in response.details.tokens] == ids
    assert response.generated_text == text
    expected = transformers_logprobs(oracle, ids, PROMPT)
    # PyTorch's int4 kernel computes in bfloat16 (int4pack_weight.py): bfloat16-sized errors.
    for token, logprob in zip(response.details.tokens, expected, strict=True):
        assert math.isclose(token.logprob, logprob, abs_tol=2e-2)


def test_a_split_that_cuts_a_group_stops_the_launch_in_one_line(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    """o_proj's 64 inputs in two groups of 32: four shards of 16 would cut each group in two."""
    gptq, _ = write_gptq_checkpoint(tiny_model("llama"), tmp_path, 32, act_order=False)
    launcher = Launcher("--model-id", str(gptq), "--num-shard", "4", "--max-shard-restarts", "0")
    try:
        assert launcher.wait(START_TIMEOUT) == 1, launcher.output
    finally:
        launcher.close()
    out = launcher.output
    assert "during start-up" in out
    assert "cannot start: --num-shard 4 would cut model.layers.0.self_attn.o_proj's 64 input " \
        "features inside a packed word of 8 or one of its 2 quantization groups; --num-shard 1, " \
        "2 work" in out
    assert "Traceback" not in out


def test_an_fp8_checkpoint_serves_its_dequantized_weights(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    fp8, oracle = write_fp8_checkpoint(tiny_model("llama"), tmp_path, "compressed-tensors")
    launcher = Launcher("--model-id", str(fp8), "--num-shard", "2")
    info, response = serve_greedy(launcher, 10)
    assert info["quantize"] == "fp8"
    assert "quantization fp8 8-bit, per-channel weight scales, static activation scales, " \
        "format compressed-tensors (pre-quantized" in launcher.output
    assert "linear layers 8 on Fp8Weight" in launcher.output
    ids, _ = transformers_greedy(oracle, PROMPT, 10)
    assert [t.id for t in response.details.tokens] == ids
    expected = transformers_logprobs(oracle, ids, PROMPT)
    for token, logprob in zip(response.details.tokens, expected, strict=True):
        assert math.isclose(token.logprob, logprob, abs_tol=1e-3)


def test_quantize_on_load_from_the_environment(tiny_model: Callable[..., Path]) -> None:
    launcher = Launcher("--model-id", str(tiny_model("llama")), "--num-shard", "1",
                        env={"QUANTIZE": "eetq"})
    info, response = serve_greedy(launcher, 8)
    assert info["quantize"] == "eetq"
    assert "quantization eetq (quantized on load, declared by --quantize)" in launcher.output
    assert "linear layers 8 on Int8WeightOnly" in launcher.output
    assert response.details.generated_tokens == 8

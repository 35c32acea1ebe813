"""transformers as the oracle: what `generate` produces on the same tiny weights."""

from __future__ import annotations

from pathlib import Path

import torch


def hf_greedy(model_path: Path, prompt: list[int], max_new: int) -> tuple[list[int], list[float]]:
    """Greedy tokens after `prompt` and the logprob of each under the raw logits."""
    from transformers import AutoModelForCausalLM

    # Eager attention is transformers' reference: SDPA drops Gemma 2's attention soft-capping.
    model = AutoModelForCausalLM.from_pretrained(
        model_path, torch_dtype=torch.float32, attn_implementation="eager"
    )
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
        output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [
        torch.log_softmax(s[0], -1)[t].item() for s, t in zip(out.logits, tokens, strict=False)
    ]
    return tokens, logprobs

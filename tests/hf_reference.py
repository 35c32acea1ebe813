"""transformers as the oracle: what `generate` produces on the same tiny weights."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch


def hf_greedy(
    model_path: Path, prompt: list[int], max_new: int, ignore_eos: bool = False
) -> tuple[list[int], list[float]]:
    """Greedy tokens after `prompt` and the logprob of each under the raw logits. An
    encoder-decoder (T5) generates from its decoder start token, its prompt encoded.
    `ignore_eos`: an EOS token does not stop it (TGI's ignore_eos_token), so there are always
    `max_new` tokens, whichever random weights the installed transformers initialised."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    seq2seq = AutoConfig.from_pretrained(model_path).is_encoder_decoder
    # Eager attention is transformers' reference: SDPA drops Gemma 2's attention soft-capping.
    model = (AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM).from_pretrained(
        model_path, torch_dtype=torch.float32, attn_implementation="eager"
    )
    if ignore_eos:
        model.generation_config.eos_token_id = None
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
        output_logits=True, return_dict_in_generate=True,
        # transformers 4.57's T5 cache has a layer per encoder layer: a deeper decoder (as the
        # tiny ones) generates without it, every step recomputed from scratch.
        use_cache=not seq2seq,
    )  # fmt: skip
    # An encoder-decoder's sequences are its decoder's: the start token, then the new ones.
    tokens = out.sequences[0, 1 if seq2seq else len(prompt) :].tolist()
    logprobs = [
        torch.log_softmax(s[0], -1)[t].item() for s, t in zip(out.logits, tokens, strict=False)
    ]
    return tokens, logprobs


def hf_vlm_greedy(
    model_path: Path, prompt: list[int], max_new: int, **inputs: torch.Tensor
) -> tuple[list[int], list[float]]:
    """A vision-language checkpoint's greedy tokens after `prompt` (the image tokens already in
    it) and each one's logprob under the raw logits, EOS ignored: AutoModelForImageTextToText's
    generate, float32 and eager attention, with the processed images and whatever else the
    family reads (`inputs`: pixel_values, image_grid_thw, token_type_ids ...)."""
    from transformers import AutoModelForImageTextToText

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForImageTextToText.from_pretrained(
            model_path, dtype=torch.float32, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, **inputs)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item()
                for s, t in zip(out.logits, tokens, strict=True)]
    return tokens, logprobs

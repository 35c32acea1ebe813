"""Tiny, randomly initialised models in real Hugging Face layout, built offline for the tests.

Each model directory holds config.json, model.safetensors (or a sharded index), tokenizer.json
trained here with `tokenizers`, tokenizer_config.json with a chat template, and
generation_config.json — exactly what a Hub snapshot looks like, so every code path that loads a
real model loads these.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
VOCAB_SIZE = 384

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "To be, or not to be, that is the question.",
    "Hello world! How are you today? I am fine, thank you.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Continuous batching adds new requests between decode steps.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000; symbols: {}[]()<>=+-*/\\\"'",
    "Unicode: café, naïve, 東京, Привет, ✓, 🙂 emoji and accents.",
    "def main():\n    print('hello')\n    return 0\n",
]

# Per-family configs: small, but every feature the family has (GQA, RoPE scaling, bias, ties).
LLAMA_FAMILY: dict[str, dict] = {
    "llama": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    },
    "mistral": {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral",
        "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 1, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "sliding_window": None,
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
        "use_sliding_window": False,
    },
}

_SMALL = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "max_position_embeddings": 256,
}
# The other families of the Llama-style decoder (shard/models/llama/model.py), each with the features
# that set it apart switched on and made to bite: windows shorter than the test prompts, soft caps
# the scores reach, head_dim independent of hidden_size, multipliers far from 1.
DECODER_FAMILIES: dict[str, dict] = {
    "gemma": {
        **_SMALL, "architectures": ["GemmaForCausalLM"], "model_type": "gemma",
        "num_key_value_heads": 1, "head_dim": 32,
    },
    "gemma2": {
        **_SMALL, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
        "num_hidden_layers": 3, "head_dim": 24, "query_pre_attn_scalar": 20,
        "sliding_window": 5, "attn_logit_softcapping": 1.0, "final_logit_softcapping": 3.0,
    },
    "gemma3_text": {
        **_SMALL, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "num_hidden_layers": 3, "head_dim": 16, "query_pre_attn_scalar": 16,
        "sliding_window": 5, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    },
    "qwen3": {
        **_SMALL, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "head_dim": 32, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    },
    "phi3": {
        **_SMALL, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
        "original_max_position_embeddings": 64, "sliding_window": 6,
        "partial_rotary_factor": 0.5,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0],
                         "long_factor": [1.0, 2.0, 4.0, 8.0]},
    },
    "starcoder2": {
        **_SMALL, "architectures": ["Starcoder2ForCausalLM"], "model_type": "starcoder2",
        "use_bias": True, "sliding_window": 5, "norm_epsilon": 1e-5,
        "hidden_act": "gelu_pytorch_tanh",
    },
    "granite": {
        **_SMALL, "architectures": ["GraniteForCausalLM"], "model_type": "granite",
        "embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.1,
        "logits_scaling": 4.0,
    },
    "cohere": {
        **_SMALL, "architectures": ["CohereForCausalLM"], "model_type": "cohere",
        "use_qk_norm": True, "logit_scale": 0.5, "tie_word_embeddings": True,
    },
}

# The GPT-style families on pytgi's own fused-QKV decoders (shard/models/gpt2.py ... mpt.py), in
# the layout their best-known checkpoints use: multi-query with one KV head (StarCoder,
# Falcon-7B), partial rotary with a parallel residual (Pythia), OPT's position offset, ALiBi.
GPT_FAMILIES: dict[str, dict] = {
    "gpt2": {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256, "n_inner": 128,
    },
    "gpt_bigcode": {
        "architectures": ["GPTBigCodeForCausalLM"], "model_type": "gpt_bigcode",
        "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256, "n_inner": 128,
        "multi_query": True,
    },
    "gpt_neox": {
        "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox",
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "rotary_pct": 0.25, "max_position_embeddings": 256,
        "use_parallel_residual": True, "tie_word_embeddings": False,
    },
    "falcon": {
        "architectures": ["FalconForCausalLM"], "model_type": "falcon",
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "multi_query": True, "parallel_attn": True, "max_position_embeddings": 256,
    },
    "opt": {
        "architectures": ["OPTForCausalLM"], "model_type": "opt",
        "hidden_size": 64, "ffn_dim": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "word_embed_proj_dim": 64, "max_position_embeddings": 256,
    },
    "bloom": {
        "architectures": ["BloomForCausalLM"], "model_type": "bloom",
        "hidden_size": 64, "n_layer": 2, "n_head": 4,
    },
    "mpt": {
        "architectures": ["MptForCausalLM"], "model_type": "mpt",
        "d_model": 64, "n_layers": 2, "n_heads": 4, "expansion_ratio": 2, "max_seq_len": 256,
    },
}

# Mixtures of experts on the Llama-style decoder (shard/layers/moe.py): top-k of a few experts
# with each family's normalisation, Qwen2-MoE's shared expert and a dense layer among sparse ones,
# Qwen3-MoE's renormalised top-3 with q/k norms, Mixtral's window shorter than the test prompts.
MOE_FAMILIES: dict[str, dict] = {
    "mixtral": {
        **_SMALL, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2,
        "sliding_window": 6,
    },
    "qwen2_moe": {
        **_SMALL, "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
        "num_hidden_layers": 3, "intermediate_size": 96, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "num_experts": 6, "num_experts_per_tok": 2,
        "mlp_only_layers": [1],
    },
    "qwen3_moe": {
        **_SMALL, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "head_dim": 32, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 3,
        "norm_topk_prob": True,
    },
}

# Encoder-decoders (shard/models/t5.py), one model class for both types, so the two share out the
# variants: a gated-GELU feed-forward (T5 v1.1, FLAN-T5, mT5) with the head tied to the embedding
# (T5's scaled head), and a ReLU one (T5 v1.0) with an untied head (ReLU with a tied head makes
# random weights repeat one token). Each has a decoder deeper than its encoder and few relative
# position buckets over a short max_distance, so that the test prompts reach the log buckets.
_T5_SMALL = {
    "architectures": ["T5ForConditionalGeneration"], "d_model": 64, "d_kv": 16, "d_ff": 128,
    "num_layers": 2, "num_decoder_layers": 3, "num_heads": 4,
    "relative_attention_num_buckets": 8, "relative_attention_max_distance": 20,
}
SEQ2SEQ_FAMILIES: dict[str, dict] = {
    "t5": {**_T5_SMALL, "model_type": "t5", "feed_forward_proj": "gated-gelu",
           "tie_word_embeddings": True},
    "mt5": {**_T5_SMALL, "model_type": "mt5", "feed_forward_proj": "relu",
            "tie_word_embeddings": False},
}

FALLBACK: dict[str, dict] = {
    # An architecture only the transformers fallback serves (partial rotary, parallel residual).
    "phi": {
        "architectures": ["PhiForCausalLM"], "model_type": "phi",
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 256, "partial_rotary_factor": 0.5,
    },
}


# Every tiny family by name: pytgi's own (the registry's model types) and the fallback's.
FAMILIES: dict[str, dict] = {
    **LLAMA_FAMILY, **DECODER_FAMILIES, **MOE_FAMILIES, **GPT_FAMILIES, **SEQ2SEQ_FAMILIES,
    **FALLBACK,
}


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """A byte-level BPE tokenizer (GPT-2/Llama-3 style) trained offline, BOS added on encode."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts * 4, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def write_tokenizer(path: Path, tok: Tokenizer, max_len: int) -> None:
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "add_bos_token": True, "model_max_length": max_len,
        "chat_template": CHAT_TEMPLATE,
    }, indent=2))
    (path / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}, indent=2)
    )


def build_model(
    path: Path, family: str, *, seed: int = 0, shard_size: str | None = None, std: float = 0.08
) -> Path:
    """Writes a tiny random model of `family` (a key of FAMILIES) to `path`.

    `std`: of the random matrices. Larger makes attention sharp, so that positions, masks and
    windows decide the tokens (at 0.08 attention is nearly uniform over the prompt)."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSeq2SeqLM,
        GenerationConfig,
    )

    spec = dict(FAMILIES[family])
    path.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(_CORPUS)
    bos, eos, pad = tok.token_to_id(BOS), tok.token_to_id(EOS), tok.token_to_id(PAD)
    model_type = spec.pop("model_type")
    seq2seq = family in SEQ2SEQ_FAMILIES
    # An encoder-decoder's decoder starts from the pad token, as T5's does.
    start = {"decoder_start_token_id": pad} if seq2seq else {}
    config = AutoConfig.for_model(
        model_type, vocab_size=VOCAB_SIZE, bos_token_id=bos, eos_token_id=eos,
        pad_token_id=pad, torch_dtype="float32", **start, **spec,
    )
    torch.manual_seed(seed)
    model = (AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM).from_config(config)
    # Random init with a larger std makes logits peaked enough that greedy ties are vanishingly rare.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, std)
            elif family not in LLAMA_FAMILY and family not in FALLBACK:
                # Norm weights and biases away from their init (Gemma's (1 + w) starts at w = 0).
                p.add_(torch.randn_like(p) * 0.2)
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, **start).save_pretrained(
        path
    )
    write_tokenizer(path, tok, config.max_position_embeddings if hasattr(config, "max_position_embeddings") else 256)
    return path


if __name__ == "__main__":
    import sys

    out = Path(sys.argv[1])
    for fam in FAMILIES:
        build_model(out / fam, fam)
        print("built", out / fam)

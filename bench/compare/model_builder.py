"""Random-weight Llama checkpoints for bench/compare/run.py, in real Hugging Face layout.

Every system under comparison loads the same directory. Output lengths must be exact for every
system (TGI's HTTP API has no ignore-EOS switch), so the checkpoint is made EOS-free: the LM-head
rows of EOS and of ids the tokenizer cannot decode are zero, so their logit is exactly 0 while
the largest of thousands of other logits is positive — greedy decoding never picks them. The
model's compute is unchanged (same shapes, same matmuls).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_CORPUS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps by the fire.",
    "Paged attention stores keys and values in fixed-size blocks of the cache.",
    "Continuous batching adds new requests between the decode steps of a running batch.",
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and words: alpha beta gamma delta epsilon zeta eta theta.",
]


@dataclass(frozen=True, slots=True)
class LlamaShape:
    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    # None: the tokenizer's vocabulary size.
    vocab_size: int | None = None
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False


# The "cpu-small" Llama: enough compute per step for batching to matter on 2 cores.
CPU_SMALL = LlamaShape("cpu-small", 256, 768, 4, 4, 2)
# Llama-3-8B's shapes (random weights; the vocabulary is padded past the tokenizer's).
LLAMA3_8B = LlamaShape(
    "llama3-8b-shape",
    4096,
    14336,
    32,
    32,
    8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
)
# Llama-3.2-1B's shapes (random weights, tied embeddings).
LLAMA32_1B = LlamaShape(
    "llama3.2-1b-shape",
    2048,
    8192,
    16,
    32,
    8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)
SHAPES = {s.name: s for s in (CPU_SMALL, LLAMA3_8B, LLAMA32_1B)}


def is_checkpoint(path: Path) -> bool:
    """True for a directory holding a config and safetensors weights (e.g. the trained demo)."""
    has_weights = any(path.glob("*.safetensors"))
    return (path / "config.json").is_file() and has_weights and (path / "tokenizer.json").is_file()


def _write_tokenizer(out: Path, source: Path | None) -> int:
    """Copies `source`'s tokenizer files, or trains a small byte-level BPE; returns its vocab."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if source is not None and (source / "tokenizer.json").is_file():
        for name in _TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy(source / name, out / name)
        return int(Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size())
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=[BOS, EOS, PAD],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS * 8, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": BOS,
                "eos_token": EOS,
                "pad_token": PAD,
                "add_bos_token": True,
                "model_max_length": 1 << 20,
            },
            indent=2,
        )
    )
    return int(tok.get_vocab_size())


def _special_ids(out: Path) -> tuple[int, int, int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = [tok.token_to_id(t) for t in (BOS, EOS, PAD)]
    if any(i is None for i in ids):
        raise ValueError(f"tokenizer in {out} lacks one of {BOS} {EOS} {PAD}")
    return ids[0], ids[1], ids[2]  # type: ignore[return-value]


def build_random_llama(
    out: Path,
    shape: LlamaShape,
    tokenizer_source: Path | None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
) -> Path:
    """Writes an EOS-free random Llama of `shape` to `out` (skipped when already built)."""
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

    marker = out / "bench_model.json"
    spec = {"shape": shape.name, "dtype": str(dtype), "seed": seed, "eos_free": True}
    if marker.is_file() and json.loads(marker.read_text()) == spec and is_checkpoint(out):
        return out
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_vocab = _write_tokenizer(out, tokenizer_source)
    bos, eos, pad = _special_ids(out)
    # One dict for transformers 4 and 5 alike: 5's LlamaConfig declares neither rope_theta nor
    # torch_dtype (it reads them from **kwargs), so mypy refuses them as keywords there.
    fields: dict[str, Any] = dict(
        vocab_size=shape.vocab_size or tokenizer_vocab,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=shape.max_position_embeddings,
        rope_theta=shape.rope_theta,
        tie_word_embeddings=shape.tie_word_embeddings,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        torch_dtype=str(dtype).removeprefix("torch."),
    )
    config = LlamaConfig(**fields)
    torch.manual_seed(seed)
    # Built directly in `dtype` on `device`: an 8B model in float32 would need 32 GB first.
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    suppress_tokens(model, [eos, *range(tokenizer_vocab, config.vocab_size)])
    model.save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad).save_pretrained(out)
    marker.write_text(json.dumps(spec))
    return out


@torch.no_grad()
def suppress_tokens(model: torch.nn.Module, token_ids: list[int]) -> None:
    """Zeroes the LM-head rows of `token_ids`: their logit is 0, below the top logit."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    if head is None or not token_ids:
        return
    # With tied embeddings this also zeroes those tokens' input embeddings; the benchmarks'
    # prompts never contain them (special and out-of-tokenizer ids).
    head.weight[torch.tensor(token_ids, device=head.weight.device)] = 0


def eos_free_copy(source: Path, out: Path) -> Path:
    """A copy of a trained checkpoint (the demo model) whose LM head can never choose EOS."""
    from transformers import AutoModelForCausalLM

    marker = out / "bench_model.json"
    # The source's weights identify it: a retrained demo model must not reuse a stale copy.
    weights = sorted(
        (p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in source.glob("*.safetensors")
    )
    spec = {"source": str(source.resolve()), "weights": weights, "eos_free": True}
    if marker.is_file() and json.loads(marker.read_text()) == spec and is_checkpoint(out):
        return out
    out.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    _, eos, _ = _special_ids(source)
    vocab = _write_tokenizer(out, source)
    suppress_tokens(model, [eos, *range(vocab, model.config.vocab_size)])
    model.save_pretrained(out, safe_serialization=True)
    if (source / "generation_config.json").is_file():
        shutil.copy(source / "generation_config.json", out / "generation_config.json")
    marker.write_text(json.dumps(spec))
    return out

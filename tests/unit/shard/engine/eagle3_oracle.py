"""A random-weight EAGLE-3 head checkpoint for the tiny Llama, and the EAGLE-3 draft forward
written out in plain PyTorch (the oracle the drafter's proposals are held to): the target's
residual streams from transformers' own Llama, full causal attention recomputed at every step,
no paging, no cache. Kept apart from the tests so that the oracle reads as one piece."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.nn import functional as F

from tests.tiny_models import VOCAB_SIZE

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 64, 4, 2, 16, 96
DRAFT_VOCAB = 200
EPS = 1e-5
# The tiny Llama has 2 layers: the streams entering layers 0 and 1, and the last one's output.
AUX = [0, 1, 2]


def head_tensors(seed: int, std: float = 0.15, own_embed: bool = False,
                 constant: int | None = None) -> dict[str, torch.Tensor]:
    """Random head weights in EAGLE-3's layout. `constant`: a final norm of zeros (all the
    draft logits 0, so draft id 0 wins) and d2t sending id 0 to the target id `constant`: a
    head that always proposes that token."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def norm() -> torch.Tensor:
        return 1 + torch.randn(HIDDEN, generator=g) * 0.2

    ids = torch.sort(torch.randperm(VOCAB_SIZE, generator=g)[:DRAFT_VOCAB]).values
    if constant is not None:
        ids[0] = constant
    t = {
        "fc.weight": rand(HIDDEN, 3 * HIDDEN),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, 2 * HIDDEN),
        "midlayer.self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
        "midlayer.mlp.gate_proj.weight": rand(INTER, HIDDEN),
        "midlayer.mlp.up_proj.weight": rand(INTER, HIDDEN),
        "midlayer.mlp.down_proj.weight": rand(HIDDEN, INTER),
        "norm.weight": torch.zeros(HIDDEN) if constant is not None else norm(),
        "lm_head.weight": rand(DRAFT_VOCAB, HIDDEN) * 4,
        "d2t": ids - torch.arange(DRAFT_VOCAB),
        "t2d": torch.zeros(VOCAB_SIZE, dtype=torch.bool).index_fill_(0, ids, True),
    }
    if own_embed:
        t["embed_tokens.weight"] = rand(VOCAB_SIZE, HIDDEN) * 4
    return t


def head_config(aux: list[int] | None = AUX, **fields: object) -> dict[str, object]:
    config: dict[str, object] = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": HIDDEN, "intermediate_size": INTER, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "num_hidden_layers": 1, "rms_norm_eps": EPS,
        "rope_theta": 10000.0, "max_position_embeddings": 256, "vocab_size": VOCAB_SIZE,
        "draft_vocab_size": DRAFT_VOCAB, "hidden_act": "silu", "tie_word_embeddings": False,
    }
    if aux is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux,
                                  "use_aux_hidden_state": True}
    config.update(fields)
    return config


def write_head(path: Path, seed: int = 0, aux: list[int] | None = AUX, **kinds: object) -> Path:
    """An EAGLE-3 head directory: config.json and model.safetensors (`kinds`: head_tensors')."""
    path.mkdir(parents=True, exist_ok=True)
    save_file(head_tensors(seed, **kinds), str(path / "model.safetensors"))  # type: ignore[arg-type]
    (path / "config.json").write_text(json.dumps(head_config(aux)))
    return path


class Oracle:
    """EAGLE-3's drafts for a token sequence, computed from scratch."""

    def __init__(self, target: Path, head: Path, aux: list[int] = AUX) -> None:
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        self.target = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        self.w = load_file(str(head / "model.safetensors"))
        self.aux = sorted(aux)

    @torch.no_grad()
    def streams(self, ids: list[int]) -> torch.Tensor:
        """[len(ids), 3 * hidden]: the residual streams entering the aux layers (id j: the
        stream entering layer j; the embedding for 0, the last layer's output for L)."""
        layers = self.target.model.layers
        taken: dict[int, torch.Tensor] = {}
        hooks = [layers[0].register_forward_pre_hook(
            lambda m, args, kwargs: taken.__setitem__(0, (args[0] if args else
                                                          kwargs["hidden_states"])[0]),
            with_kwargs=True)]
        for j in range(1, len(layers) + 1):
            hooks.append(layers[j - 1].register_forward_hook(
                lambda m, a, out, j=j: taken.__setitem__(
                    j, (out[0] if isinstance(out, tuple) else out)[0])))
        try:
            self.target(torch.tensor([ids]))
        finally:
            for h in hooks:
                h.remove()
        return torch.cat([taken[j] for j in self.aux], dim=-1)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        table = self.w.get("embed_tokens.weight")
        if table is None:
            table = self.target.model.embed_tokens.weight
        return F.embedding(ids, table)

    @torch.no_grad()
    def drafts(self, sequence: list[int], k: int) -> list[int]:
        """The k drafts after `sequence` (its last token the newest, not yet fed)."""
        w = self.w
        n = len(sequence) - 1
        fused = F.linear(self.streams(sequence[:-1]), w["fc.weight"])
        tokens = torch.tensor(sequence[1:])
        hidden = fused
        out: list[int] = []
        for _ in range(k):
            prenorm = self.layer(self.embed(tokens), hidden)
            logits = F.linear(rms(prenorm[-1], w["norm.weight"]), w["lm_head.weight"])
            d = int(logits.argmax())
            token = d + int(w["d2t"][d])
            out.append(token)
            # The next position: the draft's embedding, the head's own pre-norm state.
            tokens = torch.cat([tokens, torch.tensor([token])])
            hidden = torch.cat([hidden, prenorm[-1:]])
        assert len(hidden) >= n
        return out

    def layer(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The decoder layer over positions 0..n-1, full causal attention: pre-norm states."""
        w, n = self.w, embeds.shape[0]
        x = torch.cat([rms(embeds, w["midlayer.input_layernorm.weight"]),
                       rms(hidden, w["midlayer.hidden_norm.weight"])], dim=-1)
        q = F.linear(x, w["midlayer.self_attn.q_proj.weight"]).view(n, HEADS, HEAD_DIM)
        k = F.linear(x, w["midlayer.self_attn.k_proj.weight"]).view(n, KV_HEADS, HEAD_DIM)
        v = F.linear(x, w["midlayer.self_attn.v_proj.weight"]).view(n, KV_HEADS, HEAD_DIM)
        inv = 1.0 / 10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
        angles = torch.arange(n).float()[:, None] * inv
        cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None]
        sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None]

        def rope(t: torch.Tensor) -> torch.Tensor:
            a, b = t.chunk(2, dim=-1)
            return t * cos + torch.cat([-b, a], -1) * sin

        q, k = rope(q), rope(k)
        k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
        v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * HEAD_DIM**-0.5
        scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
        residual = F.linear(attn, w["midlayer.self_attn.o_proj.weight"]) + hidden
        m = rms(residual, w["midlayer.post_attention_layernorm.weight"])
        mlp = F.linear(F.silu(F.linear(m, w["midlayer.mlp.gate_proj.weight"]))
                       * F.linear(m, w["midlayer.mlp.up_proj.weight"]),
                       w["midlayer.mlp.down_proj.weight"])
        return mlp + residual


def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))

"""An EAGLE-3 draft head (--speculator-model DIR whose config.json names LlamaForCausalLMEagle3
or Eagle3LlamaForCausalLM): one Llama decoder layer over a paged KV cache of its own, fed each
position's token embedding beside a hidden state, proposing from a reduced vocabulary.

The checkpoint's layout (the EAGLE authors' and SpecForge's; vLLM and SGLang read the same):

    fc.weight                          [hidden, 3 * target_hidden]  the target's three layers -> one
    midlayer.input_layernorm.weight    [hidden]   on the token's embedding
    midlayer.hidden_norm.weight        [hidden]   on the hidden state
    midlayer.self_attn.{q,k,v}_proj    [heads * head_dim, 2 * hidden]  on [embedding; hidden]
    midlayer.self_attn.o_proj          [hidden, heads * head_dim]
    midlayer.post_attention_layernorm, midlayer.mlp.{gate,up,down}_proj, norm.weight
    lm_head.weight                     [draft_vocab_size, hidden]
    d2t                                [draft_vocab_size]  draft id + d2t[id] = the target's id
    t2d                                [vocab_size] bool   which target ids the draft has (unused)
    embed_tokens.weight                optional: absent, the target's embedding is used (frozen
                                       in training, so most published heads leave it out)

One step at a position (the rope positions are the target's):

    residual = hidden                       (norm_before_residual: hidden_norm(hidden))
    x = [input_layernorm(embed); hidden_norm(hidden)]
    residual = o_proj(attention(x)) + residual
    prenorm = mlp(post_attention_layernorm(residual)) + residual
    draft = d2t-mapped argmax(lm_head(norm(prenorm)))

The hidden state is fc(the target's three layers) at a position whose target forward ran, and
the head's own `prenorm` from the position before for the drafts after the first. Replicated on
every rank (one layer: small beside the target), in the target's dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from pytgi_shard.attention.backend import AttentionBackend
from pytgi_shard.attention.kv_cache import KVCache
from pytgi_shard.attention.metadata import AttentionMetadata
from pytgi_shard.layers.rotary import RotaryEmbedding, apply_rotary, rotation_tables

# config.json architectures of EAGLE-3 heads (the EAGLE authors' and vLLM's spelling).
EAGLE3_ARCHITECTURES = frozenset({"LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"})
TENSORS = (
    "fc.weight", "norm.weight", "lm_head.weight",
    "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
)


def is_eagle3(raw: Mapping[str, Any]) -> bool:
    """Whether a config.json describes an EAGLE-3 head."""
    return bool(set(raw.get("architectures") or ()) & EAGLE3_ARCHITECTURES)


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default target layers (a low, a middle and a high one), as trained by the
    EAGLE authors and read by vLLM: id j is the residual stream entering layer j."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True, slots=True)
class Eagle3Config:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Mapping[str, Any] | None
    max_position_embeddings: int
    vocab_size: int
    draft_vocab_size: int
    num_hidden_layers: int
    hidden_act: str
    norm_before_residual: bool
    # The checkpoint's own target layers (eagle_config.eagle_aux_hidden_state_layer_ids), if any.
    aux_layers: tuple[int, ...] | None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Eagle3Config:
        """The head's config.json; a ValueError naming a field that is missing or wrong."""
        try:
            hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
            vocab = int(raw["vocab_size"])
            eagle = raw.get("eagle_config") or {}
            ids = eagle.get("eagle_aux_hidden_state_layer_ids",
                            raw.get("eagle_aux_hidden_state_layer_ids"))
            if eagle.get("use_aux_hidden_state") is False:
                raise ValueError("its eagle_config.use_aux_hidden_state is false (an EAGLE-1 "
                                 "style head, which pytgi does not run)")
            return cls(
                hidden_size=hidden, num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(raw.get("rope_theta", 10000.0)),
                rope_scaling=raw.get("rope_scaling"),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                vocab_size=vocab,
                draft_vocab_size=int(raw.get("draft_vocab_size") or vocab),
                num_hidden_layers=int(raw.get("num_hidden_layers", 1)),
                hidden_act=str(raw.get("hidden_act", "silu")),
                norm_before_residual=bool(raw.get("norm_before_residual", False)),
                aux_layers=None if ids is None else tuple(int(i) for i in ids),
            )
        except KeyError as e:
            raise ValueError(f"its config.json lacks {e}") from e
        except (TypeError, ValueError) as e:
            raise ValueError(f"its config.json does not read as an EAGLE-3 head's: {e}") from e


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMS norm, in float32 as the checkpoints were trained with."""
    f = x.float()
    f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)
    return weight * f.to(x.dtype)


class Eagle3Head:
    """The head's tensors, its step over the paged cache, and its vocabulary map."""

    def __init__(self, config: Eagle3Config, tensors: Mapping[str, torch.Tensor],
                 backend: AttentionBackend, device: torch.device) -> None:
        self.config = config
        self.w = dict(tensors)
        self.backend = backend
        self.scale = config.head_dim**-0.5
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta,
                                      config.max_position_embeddings, config.rope_scaling, device)
        d2t = self.w.pop("d2t", None)
        base = torch.arange(config.draft_vocab_size, device=device)
        # The target's id of each draft id (no d2t: the vocabularies are the same).
        self.target_ids = base if d2t is None else base + d2t.to(device=device, dtype=torch.long)
        self.embed_tokens = self.w.get("embed_tokens.weight")

    def fuse(self, streams: torch.Tensor) -> torch.Tensor:
        """[n, 3 * target_hidden] the target's layers, concatenated -> [n, hidden]."""
        return F.linear(streams, self.w["fc.weight"])

    def step(
        self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
        kv_cache: KVCache, meta: AttentionMetadata, last: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layer over a varlen batch of positions (KV written at meta's slots):
        (each `last` row's draft as a target id, the rows' prenorm states), `last` None: all."""
        c, w, eps = self.config, self.w, self.config.rms_norm_eps
        normed_hidden = rms_norm(hidden, w["midlayer.hidden_norm.weight"], eps)
        residual = normed_hidden if c.norm_before_residual else hidden
        x = torch.cat([rms_norm(embeds, w["midlayer.input_layernorm.weight"], eps),
                       normed_hidden], dim=-1)
        q = F.linear(x, w["midlayer.self_attn.q_proj.weight"], w.get("midlayer.self_attn.q_proj.bias"))
        k = F.linear(x, w["midlayer.self_attn.k_proj.weight"], w.get("midlayer.self_attn.k_proj.bias"))
        v = F.linear(x, w["midlayer.self_attn.v_proj.weight"], w.get("midlayer.self_attn.v_proj.bias"))
        q = q.view(-1, c.num_heads, c.head_dim)
        k = k.view(-1, c.num_kv_heads, c.head_dim)
        cos, sin = rotation_tables(*self.rotary.cos_sin(positions), x.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        attn = self.backend.forward(
            q, k, v.view(-1, c.num_kv_heads, c.head_dim), kv_cache.keys[0], kv_cache.values[0],
            meta, self.scale,
        )
        o = F.linear(attn.reshape(-1, c.num_heads * c.head_dim),
                     w["midlayer.self_attn.o_proj.weight"])
        residual = o + residual
        n = rms_norm(residual, w["midlayer.post_attention_layernorm.weight"], eps)
        mlp = F.linear(
            F.silu(F.linear(n, w["midlayer.mlp.gate_proj.weight"]))
            * F.linear(n, w["midlayer.mlp.up_proj.weight"]),
            w["midlayer.mlp.down_proj.weight"],
        )
        prenorm = mlp + residual
        rows = prenorm if last is None else prenorm[last]
        logits = F.linear(rms_norm(rows, w["norm.weight"], eps), w["lm_head.weight"])
        return self.target_ids[logits.argmax(dim=-1)], prenorm

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        c = self.config
        return KVCache.bytes_per_token(1, c.num_kv_heads, c.head_dim, dtype)


def check_head(config: Eagle3Config, tensors: Mapping[str, torch.Tensor], target_hidden: int,
               target_vocab: int) -> None:
    """A ValueError, in one line, for a head this target cannot run: a missing tensor, a shape
    that is not the config's, or a width, vocabulary or id map that is not the target's."""
    c = config
    if c.num_hidden_layers != 1:
        raise ValueError(f"it has {c.num_hidden_layers} decoder layers; pytgi runs EAGLE-3 "
                         "heads of one")
    if c.hidden_act != "silu":
        raise ValueError(f"its hidden_act {c.hidden_act!r} is not silu")
    for name in TENSORS:
        if name not in tensors:
            raise ValueError(f"no tensor {name} (EAGLE-3's layout)")
    h, qd, kvd = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    fc = tuple(tensors["fc.weight"].shape)
    if fc[1] != 3 * target_hidden:
        raise ValueError(f"its fc takes {fc[1]} features; 3 x the target's hidden size is "
                         f"{3 * target_hidden}")
    if c.vocab_size != target_vocab:
        raise ValueError(f"its vocab_size {c.vocab_size} is not the target's {target_vocab}")
    embed = tensors.get("embed_tokens.weight")
    if embed is None and h != target_hidden:
        raise ValueError(f"its hidden size {h} is not the target's {target_hidden}, and it has "
                         "no embed_tokens of its own")
    expected = {
        "fc.weight": (h, 3 * target_hidden), "lm_head.weight": (c.draft_vocab_size, h),
        "midlayer.self_attn.q_proj.weight": (qd, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kvd, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kvd, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, qd),
        **({"embed_tokens.weight": (target_vocab, h)} if embed is not None else {}),
    }
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"its {name} is {tuple(tensors[name].shape)}, its config's "
                             f"shape is {shape}")
    d2t = tensors.get("d2t")
    if d2t is None:
        if c.draft_vocab_size != target_vocab:
            raise ValueError(f"its draft_vocab_size {c.draft_vocab_size} is not the target's "
                             f"{target_vocab}, and it has no d2t map")
        return
    if tuple(d2t.shape) != (c.draft_vocab_size,):
        raise ValueError(f"its d2t is {tuple(d2t.shape)}, not ({c.draft_vocab_size},)")
    ids = torch.arange(c.draft_vocab_size) + d2t.long()
    if int(ids.min()) < 0 or int(ids.max()) >= target_vocab:
        raise ValueError(f"its d2t maps draft ids outside the target's {target_vocab} tokens")

"""T5, FLAN-T5 and mT5 (encoder-decoder), tensor-parallel, over the paged cache.

    encoder:  x = shared(prompt)
              for each layer:  x = x + o(attention(q, k, v of norm(x)) + bias)     bidirectional
                               x = x + ff(norm(x))
              e = norm(x)      -> every decoder layer's cross K/V (k(e), v(e)), into the cache
    decoder:  y = shared(decoder tokens)                 the decoder start token, then generated
              for each layer:  y = y + o(attention(q, k, v of norm(y)) + bias)     causal, paged
                               y = y + o(attention(q(norm(y)), cross K/V))
                               y = y + ff(norm(y))
              logits = lm_head(norm(y))     tied to `shared`: times d_model**-0.5 first

As transformers' modeling_t5: scores are not scaled; the relative position bias of each stack's
first layer is added in every layer of that stack (layers/relative_position_bias.py); norms are
RMS norms without a mean; ff is relu(wi(x)) or act(wi_0(x)) * wi_1(x) into wo, which in float16
stays float32 (transformers' _keep_in_fp32_modules) with float16 hidden states clamped below inf.

Heads split across ranks (q/k/v column-parallel, o row-parallel), wi column- and wo row-parallel,
the vocabulary split in the embedding and LM head.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from pytgi_shard.attention.backend import AttentionBackend
from pytgi_shard.attention.encoder_decoder import (
    DecoderLayout,
    EncoderDecoderMetadata,
    EncoderInputs,
    EncoderLayout,
    additive,
    attend,
    gather,
)
from pytgi_shard.attention.kv_cache import KVCache
from pytgi_shard.attention.metadata import AttentionMetadata
from pytgi_shard.device.distributed import Dist
from pytgi_shard.layers.embedding import VocabParallelEmbedding
from pytgi_shard.layers.linear import ColumnParallelLinear, RowParallelLinear, head_partition
from pytgi_shard.layers.lm_head import ParallelLMHead
from pytgi_shard.layers.mlp import activation
from pytgi_shard.layers.relative_position_bias import RelativePositionBias
from pytgi_shard.models.encoder_decoder_model import EncoderDecoderModel
from pytgi_shard.models.fused_qkv_decoder import with_weights
from pytgi_shard.models.model_config import ModelConfig
from pytgi_shard.models.t5_config import T5Config
from pytgi_shard.weights.reader import Weights


def clamp_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' T5 keeps float16 hidden states finite after every sub-layer."""
    if x.dtype != torch.float16:
        return x
    top = torch.finfo(torch.float16).max
    limit = torch.where(torch.isinf(x).any(), top - 1000, top)
    return torch.clamp(x, min=-limit, max=limit)


class T5LayerNorm(nn.Module):
    """x / rms(x) * weight, statistics in float32, cast to the weight's dtype before scaling."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    @classmethod
    def load(cls, weights: Weights, prefix: str, eps: float) -> T5LayerNorm:
        return cls(weights.get_tensor(f"{prefix}.weight"), eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * normed.to(self.weight.dtype)


class T5FeedForward(nn.Module):
    """wo(relu(wi(x))) or wo(act(wi_0(x)) * wi_1(x)); the input cast to wo's dtype."""

    def __init__(
        self, wi: ColumnParallelLinear, wo: RowParallelLinear, act_name: str, gated: bool
    ) -> None:
        super().__init__()
        self.wi = wi
        self.wo = wo
        self.act = activation(act_name)
        self.gated = gated
        # float32 when transformers keeps wo so (float16 models); None: a quantized wo takes
        # the activations as they are.
        self.wo_dtype = wo.weight.dtype if isinstance(wo.weight, torch.Tensor) else None

    @classmethod
    def load(
        cls, weights: Weights, wo_weights: Weights, prefix: str, config: T5Config
    ) -> T5FeedForward:
        names = [f"{prefix}.wi_0", f"{prefix}.wi_1"] if config.gated else [f"{prefix}.wi"]
        wi = ColumnParallelLinear.load_packed(weights, names, bias=False)
        wo = RowParallelLinear.load(wo_weights, f"{prefix}.wo", bias=False)
        return cls(wi, wo, config.activation, config.gated)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.wi(x)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = self.act(gate) * up
        else:
            h = self.act(h)
        return self.wo(h if self.wo_dtype is None else h.to(self.wo_dtype))


class T5Attention(nn.Module):
    """This rank's heads of one attention: q, k and v (packed where they read the same input),
    o row-parallel."""

    def __init__(
        self,
        q: ColumnParallelLinear | None,
        qkv: ColumnParallelLinear | None,
        kv: ColumnParallelLinear | None,
        o: RowParallelLinear,
        num_heads: int,
        head_dim: int,
    ) -> None:
        super().__init__()
        self.q, self.qkv, self.kv, self.o = q, qkv, kv, o
        self.num_heads = num_heads
        self.head_dim = head_dim

    @classmethod
    def load(cls, weights: Weights, prefix: str, config: T5Config, cross: bool) -> T5Attention:
        """Self-attention: q, k, v in one matmul. Cross-attention: q alone (the decoder's input),
        k and v together (the encoder's output, once per Prefill)."""
        head_partition(config.num_heads, config.num_heads, weights.dist)
        local = config.num_heads // weights.dist.world_size

        def column(*names: str) -> ColumnParallelLinear:
            return ColumnParallelLinear.load_packed(weights, [f"{prefix}.{n}" for n in names], False)

        o = RowParallelLinear.load(weights, f"{prefix}.o", bias=False)
        if cross:
            return cls(column("q"), None, column("k", "v"), o, local, config.d_kv)
        return cls(None, column("q", "k", "v"), None, o, local, config.d_kv)

    def _heads(self, x: torch.Tensor, parts: int) -> list[torch.Tensor]:
        return [p.view(-1, self.num_heads, self.head_dim) for p in x.chunk(parts, dim=-1)]

    def encoder_forward(
        self, hidden: torch.Tensor, layout: EncoderLayout, mask: torch.Tensor
    ) -> torch.Tensor:
        """Every prompt token attends to every token of its prompt."""
        assert self.qkv is not None
        q, k, v = (layout.queries.pad(t) for t in self._heads(self.qkv(hidden), 3))
        out = layout.queries.unpad(attend(q, k, v, mask))
        return self.o(out.reshape(len(hidden), -1))

    def cross_kv(self, encoded: torch.Tensor) -> list[torch.Tensor]:
        """[tokens, heads, dim] keys and values of the encoder's output."""
        assert self.kv is not None
        return self._heads(self.kv(encoded), 2)

    def self_forward(
        self,
        hidden: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: EncoderDecoderMetadata,
        layout: DecoderLayout,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Causal attention over the request's decoder tokens. The new tokens' K/V are written
        to their slots and placed into the gathered context from here, not read back: a token a
        request can never feed back has no slot (its K/V go to the scratch block)."""
        assert self.qkv is not None
        q, k, v = self._heads(self.qkv(hidden), 3)
        context = []
        for cache_part, new in zip(cache, (k, v), strict=True):
            cache_part.view(-1, self.num_heads, self.head_dim).index_copy_(0, meta.slot_mapping, new)
            gathered = gather(cache_part, layout.self_slots).transpose(1, 2).clone()
            gathered[layout.queries.token_request, layout.token_pos] = new
            context.append(gathered.transpose(1, 2))
        out = attend(layout.queries.pad(q), context[0], context[1], mask)
        return self.o(layout.queries.unpad(out).reshape(len(hidden), -1))

    def cross_forward(
        self,
        hidden: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        layout: DecoderLayout,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """The decoder's tokens attend to their request's prompt (its cross K/V in the cache);
        with no prompt at all (Health's forward) the attention contributes nothing."""
        assert self.q is not None
        if mask is None:
            return torch.zeros_like(hidden)
        q = self._heads(self.q(hidden), 1)[0]
        keys, values = (gather(c, layout.cross_slots) for c in cache)
        out = attend(layout.queries.pad(q), keys, values, mask)
        return self.o(layout.queries.unpad(out).reshape(len(hidden), -1))


class T5EncoderLayer(nn.Module):
    def __init__(self, weights: Weights, wo_weights: Weights, prefix: str, c: T5Config) -> None:
        super().__init__()
        self.attn_norm = T5LayerNorm.load(weights, f"{prefix}.layer.0.layer_norm", c.eps)
        self.attn = T5Attention.load(weights, f"{prefix}.layer.0.SelfAttention", c, cross=False)
        self.ff_norm = T5LayerNorm.load(weights, f"{prefix}.layer.1.layer_norm", c.eps)
        self.ff = T5FeedForward.load(weights, wo_weights, f"{prefix}.layer.1.DenseReluDense", c)

    def forward(self, x: torch.Tensor, layout: EncoderLayout, mask: torch.Tensor) -> torch.Tensor:
        x = clamp_half(x + self.attn.encoder_forward(self.attn_norm(x), layout, mask))
        return clamp_half(x + self.ff(self.ff_norm(x)))


class T5DecoderLayer(nn.Module):
    def __init__(self, weights: Weights, wo_weights: Weights, prefix: str, c: T5Config) -> None:
        super().__init__()
        self.self_norm = T5LayerNorm.load(weights, f"{prefix}.layer.0.layer_norm", c.eps)
        self.self_attn = T5Attention.load(weights, f"{prefix}.layer.0.SelfAttention", c, False)
        self.cross_norm = T5LayerNorm.load(weights, f"{prefix}.layer.1.layer_norm", c.eps)
        self.cross = T5Attention.load(weights, f"{prefix}.layer.1.EncDecAttention", c, True)
        self.ff_norm = T5LayerNorm.load(weights, f"{prefix}.layer.2.layer_norm", c.eps)
        self.ff = T5FeedForward.load(weights, wo_weights, f"{prefix}.layer.2.DenseReluDense", c)

    def forward(
        self,
        y: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor],
        meta: EncoderDecoderMetadata,
        layout: DecoderLayout,
        masks: tuple[torch.Tensor, torch.Tensor | None],
    ) -> torch.Tensor:
        y = clamp_half(y + self.self_attn.self_forward(self.self_norm(y), cache, meta, layout,
                                                       masks[0]))
        y = clamp_half(y + self.cross.cross_forward(self.cross_norm(y), cache, layout, masks[1]))
        return clamp_half(y + self.ff(self.ff_norm(y)))


class T5(nn.Module, EncoderDecoderModel):
    def __init__(self, config: T5Config, weights: Weights, wo_weights: Weights) -> None:
        super().__init__()
        c = self.config = config
        dist = weights.dist
        shared = "shared.weight" if "shared.weight" in weights else "encoder.embed_tokens.weight"
        self.embed = VocabParallelEmbedding.load(weights, shared)
        self.encoder_bias = RelativePositionBias.load(
            weights, "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
            True, c.num_buckets, c.max_distance,
        )  # fmt: skip
        self.decoder_bias = RelativePositionBias.load(
            weights, "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
            False, c.num_buckets, c.max_distance,
        )  # fmt: skip
        self.encoder_layers = nn.ModuleList(
            T5EncoderLayer(weights, wo_weights, f"encoder.block.{i}", c)
            for i in range(c.num_layers)
        )
        self.encoder_norm = T5LayerNorm.load(weights, "encoder.final_layer_norm", c.eps)
        self.decoder_layers = nn.ModuleList(
            T5DecoderLayer(weights, wo_weights, f"decoder.block.{i}", c)
            for i in range(c.num_decoder_layers)
        )
        self.decoder_norm = T5LayerNorm.load(weights, "decoder.final_layer_norm", c.eps)
        head = shared if c.tie_word_embeddings else "lm_head.weight"
        self.lm_head = ParallelLMHead.load(weights, head)
        # T5 v1.0's tied head reads the hidden state rescaled (Mesh TensorFlow's T5).
        self.head_scale = c.d_model**-0.5 if c.scale_decoder_outputs else None
        self.model_type = c.model_type
        self.num_layers = c.num_decoder_layers
        self.num_kv_heads = c.num_heads // dist.world_size
        self.head_dim = c.d_kv
        self.vocab_size = weights.shape(head)[0]
        self.dtype = weights.dtype
        self.device = dist.device
        self.max_position_embeddings = c.max_position_embeddings
        self.decoder_start_token_id = c.decoder_start_token_id

    @classmethod
    def load(
        cls, config: ModelConfig, dtype: torch.dtype, dist: Dist, backend: AttentionBackend
    ) -> T5:
        """The registry's loader. `backend` is not used: the attention kernels have no relative
        position bias (attention/encoder_decoder.py attends in plain PyTorch)."""
        t5 = T5Config.read(config.raw, config.path)

        def build(weights: Weights) -> T5:
            if dtype != torch.float16:
                return cls(t5, weights, weights)
            return cls(t5, weights, weights.with_dtype(torch.float32))

        return with_weights(config, dtype, dist, build)

    @torch.inference_mode()
    def encode(self, inputs: EncoderInputs, kv_cache: KVCache) -> None:
        layout = EncoderLayout.of(inputs)
        bias = self.encoder_bias(layout.positions, layout.positions).unsqueeze(0)
        mask = torch.where(layout.keys_allowed, bias, float("-inf")).to(self.dtype)
        x = self.embed(inputs.input_ids)
        for layer in self.encoder_layers:
            x = layer(x, layout, mask)
        encoded = self.encoder_norm(x)
        for i, layer in enumerate(self.decoder_layers):
            cross = cast(T5DecoderLayer, layer).cross
            for cache, new in zip(
                (kv_cache.keys[i], kv_cache.values[i]), cross.cross_kv(encoded), strict=True
            ):
                cache.view(-1, *cache.shape[2:]).index_copy_(0, inputs.cross_slots, new)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        lm_head_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The decoder over the flat batch (positions: decoder positions); a Prefill's
        EncoderDecoderMetadata.encoder is encoded first."""
        m = EncoderDecoderMetadata.of(meta)
        if m.encoder is not None:
            self.encode(m.encoder, kv_cache)
        layout = DecoderLayout.of(m, positions)
        bias = self.decoder_bias(layout.query_pos, layout.key_pos)
        masks = (
            additive(layout.self_allowed, bias, self.dtype),
            additive(layout.cross_allowed, None, self.dtype) if m.max_encoder_length else None,
        )
        y = self.embed(input_ids)
        for i, layer in enumerate(self.decoder_layers):
            y = layer(y, (kv_cache.keys[i], kv_cache.values[i]), m, layout, masks)
        if lm_head_indices is not None:
            y = y[lm_head_indices]
        y = self.decoder_norm(y)
        if self.head_scale is not None:
            y = y * self.head_scale
        return self.lm_head(y)

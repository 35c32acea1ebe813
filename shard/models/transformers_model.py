"""Any other causal LM, served through transformers on one shard, over our paged KV cache.

transformers calls a registered attention function from every attention layer; ours reads and
writes our KVCache through our attention backend, so the model runs the same flat, paged batch as
our own models: input_ids [1, T] and position_ids [1, T] with every request's new tokens side by
side, no transformers cache (use_cache=False) and no mask (the backend derives it from the
AttentionMetadata).

The cache and metadata reach the attention function through a context object bound to every
module of the model for the duration of one forward, not through the forward's keyword
arguments: some heads drop those before they reach the layers (GPT2LMHeadModel in transformers
4.57 does), and the full model forward must run for its own logit post-processing.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from pytgi_shard.attention.backend import AttentionBackend
from pytgi_shard.attention.kv_cache import KVCache
from pytgi_shard.attention.metadata import AttentionMetadata
from pytgi_shard.device.distributed import Dist
from pytgi_shard.models import MODELS
from pytgi_shard.models.model import Model

ATTENTION_NAME = "pytgi_paged"
# The attribute under which every module of a loaded model finds its _PagedContext.
CONTEXT_ATTR = "_pytgi_paged_context"


@dataclass
class _PagedContext:
    """What the attention layers of one model need during one forward."""

    backend: AttentionBackend
    kv_cache: KVCache | None = None
    meta: AttentionMetadata | None = None


def _scale(module: torch.nn.Module, head_dim: int, scaling: float | None) -> float:
    """The softmax scale: the layer's own when it passes one; GPT-2's flags otherwise."""
    if scaling is not None:
        return float(scaling)
    scale = head_dim**-0.5 if getattr(module, "scale_attn_weights", True) else 1.0
    if getattr(module, "scale_attn_by_inverse_layer_idx", False):
        scale /= float(getattr(module, "layer_idx", 0)) + 1.0
    return scale


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over our cache: [1, H, T, D] -> [1, T, H, D]."""
    context: _PagedContext | None = getattr(module, CONTEXT_ATTR, None)
    if context is None or context.kv_cache is None or context.meta is None:
        raise RuntimeError(
            f"{type(module).__name__} ran paged attention outside a TransformersModel forward"
        )
    layer_idx = getattr(module, "layer_idx", None)
    if layer_idx is None:
        raise RuntimeError(f"{type(module).__name__} has no layer_idx to find its cache with")
    if softcap is not None or kwargs.get("s_aux") is not None:
        raise RuntimeError("attention logit soft-capping and sinks are not supported")
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    kv_cache = context.kv_cache
    out = context.backend.forward(
        q, k, v,
        kv_cache.keys[layer_idx], kv_cache.values[layer_idx],
        context.meta, _scale(module, q.shape[-1], scaling), sliding_window,
    )
    return out.unsqueeze(0), None


def _check_supported(config: PretrainedConfig, dist: Dist) -> None:
    model_type = config.model_type
    if dist.world_size > 1:
        raise ValueError(
            f"Sharded {model_type} is not supported: only pytgi's own implementations shard "
            f"({', '.join(sorted(MODELS))}); use --num-shard 1"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{model_type} is an encoder-decoder model; only causal LMs are served")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError(f"{model_type} soft-caps attention logits, which the paged path lacks")
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if model_class is not None and not getattr(model_class, "_supports_attention_backend", False):
        _unsupported(model_type)


def _unsupported(model_type: str) -> None:
    raise ValueError(
        f"{model_type} cannot be served: its transformers implementation does not use the "
        "pluggable attention interface that the paged KV cache needs"
    )


def _max_positions(config: PretrainedConfig) -> int:
    # The engine sizes warmup and the token limits from it, so a model must state it.
    limit = getattr(config, "max_position_embeddings", None)
    if not limit:
        raise ValueError(f"{config.model_type} config.json has no max_position_embeddings")
    return int(limit)


# Names transformers gives learned position tables (GPT-2/GPT-Neo wpe, OPT/BioGPT embed_positions,
# BERT-style position_embeddings); sinusoidal tables under those names are not nn.Embedding.
_POSITION_TABLES = ("wpe", "embed_positions", "position_embeddings")


def _learned_positions(model: torch.nn.Module) -> bool:
    """Whether `model` looks its positions up in a learned nn.Embedding table."""
    return any(
        isinstance(module, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in _POSITION_TABLES
        for name, module in model.named_modules()
    )


def _window(config: PretrainedConfig) -> int | None:
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(kind != "sliding_attention" for kind in layer_types):
        return None
    return int(window) if window else None


class TransformersModel(Model):
    """A transformers AutoModelForCausalLM behind the Model interface (one shard only)."""

    graph_capturable = False
    fp8_kv_refusal = (
        "the transformers fallback keeps the KV cache in the model's dtype (pytgi's own "
        "implementations support it)"
    )

    def __init__(
        self, model: Any, config: PretrainedConfig, backend: AttentionBackend, dist: Dist
    ) -> None:
        self.model = model
        self.context = _PagedContext(backend)
        for module in model.modules():
            # object.__setattr__: a plain attribute, not registered as a submodule or buffer.
            object.__setattr__(module, CONTEXT_ATTR, self.context)
        heads = config.num_attention_heads
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.dtype = next(model.parameters()).dtype
        self.device = dist.device
        self.model_type = config.model_type
        self.max_position_embeddings = _max_positions(config)
        self.sliding_window = _window(config)
        self.learned_positions = _learned_positions(model)
        parameters = inspect.signature(model.forward).parameters
        self._logits_to_keep = "logits_to_keep" in parameters

    @classmethod
    def load(
        cls,
        model_path: Path,
        dtype: torch.dtype,
        dist: Dist,
        backend: AttentionBackend,
        trust_remote_code: bool = False,
    ) -> TransformersModel:
        remote = {"trust_remote_code": True} if trust_remote_code else {}
        try:
            config = AutoConfig.from_pretrained(model_path, local_files_only=True, **remote)
        except (ValueError, KeyError, OSError) as e:
            raise ValueError(f"cannot load the model config at {model_path}: {e}") from e
        config = config.get_text_config()
        _check_supported(config, dist)
        AttentionInterface.register(ATTENTION_NAME, paged_attention)
        try:
            model: Any = AutoModelForCausalLM.from_pretrained(
                model_path,
                dtype=dtype,
                attn_implementation=ATTENTION_NAME,
                use_safetensors=True,
                local_files_only=True,
                **remote,
            )
        except (ValueError, KeyError, OSError) as e:
            raise ValueError(f"transformers cannot load {model_path}: {e}") from e
        if not getattr(model, "_supports_attention_backend", False):
            _unsupported(config.model_type)
        model.to(dist.device).eval()
        return cls(model, config, backend, dist)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        lm_head_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        extra: dict[str, Any] = {}
        select_here = lm_head_indices is not None and not self._logits_to_keep
        if lm_head_indices is not None and self._logits_to_keep:
            # The model projects only these hidden states to the vocabulary.
            extra["logits_to_keep"] = lm_head_indices
        self.context.kv_cache, self.context.meta = kv_cache, meta
        try:
            out = self.model(
                input_ids=input_ids.unsqueeze(0),
                position_ids=positions.unsqueeze(0),
                use_cache=False,
                **extra,
            )
        finally:
            # Drop the references so a finished batch's cache view is not kept alive.
            self.context.kv_cache, self.context.meta = None, None
        logits = out.logits[0]
        if select_here:
            logits = logits[lm_head_indices]
        return logits.float()

"""The shard's Info answer: what the router must know of the model and of how this shard steps
(chunking, prefix caching, block size) before it can schedule anything."""

from __future__ import annotations

import torch

from pytgi_proto import generate_pb2
from pytgi_shard.models.model import Model
from pytgi_shard.settings import ShardSettings

# The wire's dtype names (TGI's): the model's dtype as Info reports it.
DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def info_response(
    model: Model,
    settings: ShardSettings,
    world_size: int,
    block_size: int,
    encoder_decoder: bool,
) -> generate_pb2.InfoResponse:
    out = generate_pb2.InfoResponse(
        requires_padding=False,
        dtype=DTYPE_NAMES.get(model.dtype, str(model.dtype)),
        device_type=model.device.type,
        # Drafts per sequence and step (--speculate); the router holds KV slots for them.
        speculate=settings.speculate if not encoder_decoder else 0,
        # A Prefill mixes the cached batch's decode rows with the newcomers' chunks, and new
        # tokens attend over KV already in their blocks (cache_len). An encoder-decoder's prompt
        # is encoded whole and leaves no decoder KV to continue from or reuse.
        support_chunking=not encoder_decoder,
        use_prefix_caching=not encoder_decoder,
        attention_impl=settings.attention or "reference",
        block_size=block_size,
        model_type=model.model_type,
        world_size=world_size,
        max_position_embeddings=model.max_position_embeddings,
        vocab_size=model.vocab_size,
        quantize=settings.quantize or "",
    )
    if model.sliding_window is not None:
        out.window_size = model.sliding_window
    return out

"""The interface of an encoder-decoder model (T5): a Model whose prompt is encoded, not decoded.

The engine serves it through the same flat, paged batch as any decoder, except that a request's
sequence on the shard is its decoder's: the decoder start token, then the generated tokens
(shard/engine/encoder_decoder_batch.py). `forward` runs the decoder; a Prefill's metadata also carries
the newcomers' prompts (attention/encoder_decoder.py, EncoderDecoderMetadata.encoder), which the
forward encodes first, writing every decoder layer's cross-attention K/V into the first slots
of each request's blocks, where every later step reads them. The encoder never runs again.
"""

from __future__ import annotations

from abc import abstractmethod

from pytgi_shard.attention.encoder_decoder import EncoderInputs
from pytgi_shard.attention.kv_cache import KVCache
from pytgi_shard.models.model import Model


class EncoderDecoderModel(Model):
    # The decoder's first input token (T5: the pad token).
    decoder_start_token_id: int
    # The attention gathers are shaped by the context lengths, so a decode is not capturable.
    graph_capturable = False
    fp8_kv_refusal = (
        "the encoder-decoder path writes its cross-attention K/V into the cache unquantized"
    )

    @abstractmethod
    def encode(self, inputs: EncoderInputs, kv_cache: KVCache) -> None:
        """Runs the encoder over `inputs`' prompts and writes each decoder layer's cross-attention
        K/V of every prompt token to `kv_cache` at inputs.cross_slots."""

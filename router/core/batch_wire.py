"""The requests as the wire carries them: a step's Prefill batch and each request's `Request`.

Built by the scheduler (a step's chunks) and at submission (a request's message, once); the
shards' answers come back through running_batch.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from pytgi_proto import generate_pb2
from pytgi_router.core.prefix_cache import PrefixCache
from pytgi_router.core.request import ValidRequest
from pytgi_router.core.step_plan import Chunk


def build_batch(batch_id: int, chunks: list[Chunk], cache: PrefixCache) -> generate_pb2.Batch:
    """The Prefill message for this step's chunks: each request with its whole block table, the
    tokens already in its blocks (cache_len) and how many to compute now (chunk_len)."""
    requests = []
    max_blocks = 0
    total_blocks = 0
    for chunk in chunks:
        entry = chunk.entry
        pb = entry.pb
        blocks = cache.table(entry.id)
        pb.blocks[:] = blocks
        pb.cache_len = chunk.cache_len
        pb.chunk_len = chunk.length
        if entry.request.images:
            needed = chunk_images(entry.request.images, chunk.cache_len, chunk.end)
            # Copied into the message only when the set changes: an image is megabytes.
            if [(i.token_offset, bool(i.pixel_values)) for i in pb.images] != [
                (i.token_offset, bool(i.pixel_values)) for i in needed
            ]:
                del pb.images[:]
                pb.images.extend(needed)
        requests.append(pb)
        max_blocks = max(max_blocks, len(blocks))
        total_blocks += len(blocks)
    return generate_pb2.Batch(
        id=batch_id,
        requests=requests,
        size=len(requests),
        max_tokens=total_blocks * cache.block_size,
        max_blocks=max_blocks,
    )


def chunk_images(images: Sequence[generate_pb2.Image], start: int, end: int
                 ) -> list[generate_pb2.Image]:
    """Every image of the request, with its pixel values only where its tokens overlap the
    chunk's [start, end) (a processed image is megabytes; the chunks before and after it need
    none of it). The others go as their grid and token span alone: M-RoPE's position of any
    token depends on every image before it, which a chunk after a prefix-cache hit or a
    resumed request has not computed (shard/engine/request_media.py)."""
    return [
        i if i.token_offset < end and start < i.token_offset + i.token_count else _span_only(i)
        for i in images
    ]


def _span_only(image: generate_pb2.Image) -> generate_pb2.Image:
    return generate_pb2.Image(grid=image.grid, token_offset=image.token_offset,
                              token_count=image.token_count, content_hash=image.content_hash)


def request_pb(entry_id: int, request: ValidRequest) -> generate_pb2.Request:
    """The request's wire form, built once at submission (blocks, cache_len and chunk_len are
    filled in with each chunk).

    Raises ValueError for a value the wire cannot carry (e.g. a seed beyond 64 bits).
    """
    stopping = request.stopping
    return generate_pb2.Request(
        id=entry_id,
        inputs=request.inputs,
        truncate=request.truncate,
        parameters=request.sampling,
        stopping_parameters=generate_pb2.StoppingCriteriaParameters(
            max_new_tokens=stopping.max_new_tokens,
            stop_sequences=stopping.stop_sequences,
            ignore_eos_token=stopping.ignore_eos_token,
        ),
        prefill_logprobs=request.prefill_logprobs,
        top_n_tokens=request.top_n_tokens,
        input_ids=request.input_ids,
        add_special_tokens=request.add_special_tokens,
        adapter_index=request.adapter_index,
    )

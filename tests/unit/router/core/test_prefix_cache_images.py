"""The prefix cache and images (issue 28 item 4): a prompt's image tokens are keyed by their
image's content hash, so the same text with different images never shares KV blocks, the same
image and text do, and the text before the first image still matches."""

from __future__ import annotations

from pytgi_proto import generate_pb2
from pytgi_proto.parameters import neutral_sampling
from pytgi_router.core.batch_wire import build_batch, request_pb
from pytgi_router.core.prefix_cache import PrefixCache, media_keyed
from pytgi_router.core.request import Entry, StoppingParameters, ValidRequest
from pytgi_router.core.request_stream import RequestStream
from pytgi_router.core.step_plan import Chunk, admit_newcomers

BLOCK = 4
PAD = 99  # the image token
# 8 text tokens (2 blocks), an image of 8 tokens (2 blocks), 5 text tokens.
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8] + [PAD] * 8 + [9, 10, 11, 12, 13]
RED, BLUE = bytes(range(16)), bytes(range(1, 17))


def entry(entry_id: int, image_hash: bytes | None) -> Entry:
    images = () if image_hash is None else (generate_pb2.Image(
        token_offset=8, token_count=8, content_hash=image_hash, dtype="float32",
        grid=[1, 4, 8], shape=[1, 4], pixel_values=bytes(16)),)
    request = ValidRequest(
        inputs="x", input_ids=list(PROMPT), truncate=len(PROMPT),
        sampling=neutral_sampling(), stopping=StoppingParameters(max_new_tokens=4),
        images=images)
    return Entry(entry_id, request, RequestStream(), request_pb(entry_id, request))


def run_and_release(cache: PrefixCache, e: Entry) -> int:
    """Admits `e` as the scheduler does, commits its prompt's KV as the running batch does,
    releases it; returns the tokens its admission found cached."""
    (chunk,), _ = admit_newcomers(cache, [e], 10**6, None, 0)
    cache.commit(e.id, e.key_tokens[:len(PROMPT)])
    cache.release(e.id)
    return chunk.cache_len


def test_media_keyed_replaces_each_image_span_by_its_hash() -> None:
    keyed = media_keyed([1, PAD, PAD, 2, PAD, 3], [(1, 2, RED), (4, 1, BLUE)])
    red, blue = -1 - int.from_bytes(RED, "big"), -1 - int.from_bytes(BLUE, "big")
    assert keyed == [1, red, red, 2, blue, 3]
    assert red < 0 and blue < 0 and red != blue


def test_the_same_text_with_another_image_shares_only_the_text_before_it() -> None:
    cache = PrefixCache(num_blocks=64, block_size=BLOCK)
    assert run_and_release(cache, entry(1, RED)) == 0
    # Blue: the two text blocks before the image match, the image's blocks and after do not.
    assert run_and_release(cache, entry(2, BLUE)) == 8
    # Red again: everything but the last (partial) block.
    assert run_and_release(cache, entry(3, RED)) == 20
    # Text only (the image tokens as plain ids): the text before the image only.
    assert run_and_release(cache, entry(4, None)) == 8


def test_key_tokens_follow_the_generated_tokens() -> None:
    e = entry(5, RED)
    assert e.key_tokens[8:16] == [-1 - int.from_bytes(RED, "big")] * 8
    e.tokens += [42, 43]
    assert e.key_tokens[len(PROMPT):] == [42, 43] and len(e.key_tokens) == len(e.tokens)
    plain = entry(6, None)
    assert plain.key_tokens is plain.tokens  # text requests pay nothing


def test_a_chunk_carries_every_image_span_and_the_pixels_its_tokens_overlap() -> None:
    """Pixel values only with the chunks computing the image's tokens; its grid and span with
    every chunk (the shard's M-RoPE positions of any token depend on the images before it)."""
    cache = PrefixCache(num_blocks=64, block_size=BLOCK)
    e = entry(7, RED)
    assert cache.admit(e.id, e.key_tokens) is not None
    assert not e.pb.images  # nothing until a chunk needs it
    for start, end, carried in [(0, 8, 0), (4, 12, 1), (15, 17, 1), (16, 21, 0), (0, 21, 1)]:
        batch = build_batch(1, [Chunk.of(e, start, end - start)], cache)
        (image,) = batch.requests[0].images
        assert len(image.pixel_values) == 16 * carried, (start, end)
        assert (image.token_offset, image.token_count, list(image.grid)) == (8, 8, [1, 4, 8])
        assert image.content_hash == RED

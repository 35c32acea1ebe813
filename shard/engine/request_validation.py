"""A request's checks against the shard's limits before it joins a batch: the sequence (prompt and
any generated_ids), the chunk computed this step, max_new_tokens, its KV blocks and explicit
slots; and a BlockGrant's blocks. Nothing reaches the model that it would reject (the router
checks the same, this is the shard's own guard)."""

from __future__ import annotations

from collections.abc import Container, Sequence

from pytgi_proto import generate_pb2
from pytgi_shard.errors import InvalidRequest


def chunk_end(pb: generate_pb2.Request, sequence_length: int) -> int:
    """Where this step's computed tokens end: cache_len + chunk_len, or the sequence's end."""
    return pb.cache_len + pb.chunk_len if pb.chunk_len else sequence_length


def validate_request(
    pb: generate_pb2.Request,
    sequence: list[int],
    vocab_size: int,
    block_size: int,
    num_blocks: int,
) -> None:
    """Raises InvalidRequest unless the shard can serve `pb` (whose sequence is input_ids then
    generated_ids: `sequence`) as asked."""
    who = f"request {pb.id}"
    max_new = pb.stopping_parameters.max_new_tokens
    if not pb.input_ids:
        raise InvalidRequest(f"{who}: input_ids is empty")
    if max_new == 0:
        raise InvalidRequest(f"{who}: max_new_tokens must be > 0")
    if len(pb.generated_ids) >= max_new:
        raise InvalidRequest(
            f"{who}: {len(pb.generated_ids)} generated_ids leave nothing to generate under "
            f"max_new_tokens {max_new}"
        )
    if max(sequence) >= vocab_size:
        raise InvalidRequest(
            f"{who}: token id {max(sequence)} is not below the vocabulary size {vocab_size}"
        )
    end = _validate_chunk(pb, len(sequence))
    # The tokens computed now, plus the next one (the overlap scheduler's look-ahead writes it);
    # the last token a request may generate is never fed back, so it never needs a slot.
    needed = min(end + 1, len(pb.input_ids) + max_new - 1)
    have = len(pb.blocks) * block_size
    if have < needed:
        raise InvalidRequest(
            f"{who}: {len(pb.blocks)} blocks of {block_size} hold {have} tokens; computing "
            f"tokens up to {end} of {len(sequence)} (and the next one) needs {needed}"
        )
    validate_blocks(pb.id, pb.blocks, num_blocks)
    if pb.slots:
        validate_slots(pb, block_size, end)


def _validate_chunk(pb: generate_pb2.Request, sequence_length: int) -> int:
    """The end of the chunk computed this step: tokens [cache_len, end) of the sequence."""
    who = f"request {pb.id}"
    if pb.cache_len >= sequence_length:
        raise InvalidRequest(
            f"{who}: cache_len {pb.cache_len} leaves no token of its {sequence_length}-token "
            "sequence to compute (cache_len must be < len(input_ids) + len(generated_ids))"
        )
    end = chunk_end(pb, sequence_length)
    if end > sequence_length:
        raise InvalidRequest(
            f"{who}: cache_len {pb.cache_len} + chunk_len {pb.chunk_len} goes past its "
            f"{sequence_length}-token sequence"
        )
    return end


def validate_blocks(request_id: int, blocks: Sequence[int], num_blocks: int) -> None:
    """Every block inside the KV cache, none listed twice (two positions would share a slot)."""
    if blocks and max(blocks) >= num_blocks:
        raise InvalidRequest(
            f"request {request_id}: block {max(blocks)} is outside the KV cache ({num_blocks} "
            "blocks; was Warmup called?)"
        )
    if len(set(blocks)) != len(blocks):
        raise InvalidRequest(f"request {request_id}: a block is listed twice in its block table")


def validate_slots(pb: generate_pb2.Request, block_size: int, end: int) -> None:
    """Attention reads the cache through block tables, so explicit slots must follow them."""
    if len(pb.slots) > len(pb.blocks) * block_size:
        raise InvalidRequest(f"request {pb.id}: more slots than its blocks hold")
    expected = [
        pb.blocks[i // block_size] * block_size + i % block_size for i in range(len(pb.slots))
    ]
    if list(pb.slots) != expected:
        raise InvalidRequest(
            f"request {pb.id}: slots must be the consecutive slots of its blocks "
            "(slot i = blocks[i // block_size] * block_size + i % block_size)"
        )
    if len(pb.slots) < end:
        raise InvalidRequest(
            f"request {pb.id}: {len(pb.slots)} slots for the {end} tokens computed so far"
        )


def validate_grants(
    grants: Sequence[generate_pb2.BlockGrant],
    blocks_of: dict[int, list[int]],
    num_blocks: int,
) -> None:
    """BlockGrants append blocks to running requests (`blocks_of`: request id -> its blocks):
    each names one of them, once, with blocks inside the cache that it does not hold yet."""
    seen: set[int] = set()
    for grant in grants:
        rid = grant.request_id
        if rid not in blocks_of:
            raise InvalidRequest(f"BlockGrant for request {rid}, which is not in the batch")
        if rid in seen:
            raise InvalidRequest(f"two BlockGrants for request {rid}")
        seen.add(rid)
        validate_blocks(rid, [*blocks_of[rid], *grant.blocks], num_blocks)


def check_new_batch(
    batch_id: int,
    request_ids: Sequence[int],
    cached_id: int | None,
    cached_request_ids: Sequence[int],
    known_batch_ids: Container[int],
    grants: int,
) -> None:
    """A Prefill's new batch: a fresh id (or the cached batch's own), no request already in the
    cached batch, and BlockGrants only for a cached batch."""
    if batch_id in known_batch_ids and batch_id != cached_id:
        raise InvalidRequest(f"batch {batch_id} already exists in the shard's cache")
    if cached_id is None:
        if grants:
            raise InvalidRequest("BlockGrants in a Prefill without a cached batch")
        return
    clash = set(cached_request_ids) & set(request_ids)
    if clash:
        raise InvalidRequest(f"requests {sorted(clash)} are already in batch {cached_id}")


def check_decode_batches(ids: Sequence[int]) -> None:
    """A Decode names at least one batch, each once."""
    if not ids:
        raise InvalidRequest("Decode needs at least one batch")
    if len(set(ids)) != len(ids):
        raise InvalidRequest(f"Decode lists a batch twice: {list(ids)}")

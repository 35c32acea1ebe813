"""A request's checks against the shard's limits before it joins a batch: the prompt, its
max_new_tokens, its KV blocks and explicit slots. Nothing reaches the model that it would reject
(the router checks the same, this is the shard's own guard)."""

from __future__ import annotations

from pytgi_proto import generate_pb2
from pytgi_shard.errors import InvalidRequest


def validate_request(
    pb: generate_pb2.Request, prompt: list[int], vocab_size: int, block_size: int, num_blocks: int
) -> None:
    """Raises InvalidRequest unless the shard can serve `pb` (prompt `prompt`) as asked."""
    who = f"request {pb.id}"
    max_new = pb.stopping_parameters.max_new_tokens
    if not prompt:
        raise InvalidRequest(f"{who}: input_ids is empty")
    if max_new == 0:
        raise InvalidRequest(f"{who}: max_new_tokens must be > 0")
    if max(prompt) >= vocab_size:
        raise InvalidRequest(
            f"{who}: token id {max(prompt)} is not below the vocabulary size {vocab_size}"
        )
    # The last generated token is never fed back, so its KV never needs a slot.
    needed = len(prompt) + max_new - 1
    have = len(pb.blocks) * block_size
    if have < needed:
        raise InvalidRequest(
            f"{who}: {len(pb.blocks)} blocks of {block_size} hold {have} tokens; "
            f"{len(prompt)} prompt + {max_new} max_new_tokens need {needed}"
        )
    if pb.blocks and max(pb.blocks) >= num_blocks:
        raise InvalidRequest(
            f"{who}: block {max(pb.blocks)} is outside the KV cache ({num_blocks} blocks; "
            "was Warmup called?)"
        )
    if pb.slots:
        validate_slots(pb, block_size)


def validate_slots(pb: generate_pb2.Request, block_size: int) -> None:
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
    if len(pb.slots) < len(pb.input_ids):
        raise InvalidRequest(
            f"request {pb.id}: {len(pb.slots)} slots for {len(pb.input_ids)} prompt tokens"
        )

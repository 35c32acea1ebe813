"""BlockGrants: KV blocks the router appends to running requests as their sequences grow.

The router allocates KV on demand: before each step every running sequence holds its known
tokens plus one (the token this step computes and the overlap scheduler's look-ahead writes).
Grants are checked before any batch changes, so a bad one leaves the shard's state intact.
"""

from __future__ import annotations

from collections.abc import Sequence

from pytgi_proto import generate_pb2
from pytgi_shard.engine.batch import Batch
from pytgi_shard.engine.request_validation import validate_grants
from pytgi_shard.errors import InvalidRequest

Grants = dict[int, list[int]]


def checked_grants(
    grants: Sequence[generate_pb2.BlockGrant], batches: Sequence[Batch], num_blocks: int
) -> Grants:
    """The grants as request id -> blocks, once they name requests of `batches` with valid new
    blocks and leave every request a slot for the token its next forward feeds."""
    if grants:
        blocks_of = {r.id: r.blocks for b in batches for r in b.requests}
        validate_grants(grants, blocks_of, num_blocks)
    by_id = {g.request_id: list(g.blocks) for g in grants}
    for batch in batches:
        if grants or batch.headroom() < 0:
            slack = batch.slack_after(by_id)
            short = [rid for rid, s in zip(batch.request_ids, slack, strict=True) if s < 0]
            if short:
                raise InvalidRequest(
                    f"requests {short} of batch {batch.batch_id} have no KV slot for the token "
                    "this step feeds: grant their next block (BlockGrant) with the step"
                )
    return by_id


def apply_grants(batch: Batch, grants: Grants) -> bool:
    """Appends the checked grants to `batch`'s block tables; True when a row had no slot for the
    look-ahead launched after its last step (it wrote to the scratch block), so that look-ahead's
    logits must not be used."""
    blind = batch.headroom() < 0
    batch.grow(grants)
    return blind

"""How a vision tower's weights are split over the tensor-parallel ranks: as the text
decoder's. Each rank holds 1/world of the tower's attention heads (q, k and v column-parallel,
the output projection row-parallel: one all-reduce) and of its MLP's hidden features (up
column-, down row-parallel: one all-reduce), so a tower's weights per rank shrink with the
ranks as the decoder's do, for two all-reduces per layer over an image's rows. Every rank runs
the tower on the same pixels in the same prefill step (the engine is SPMD), so the collectives
pair up; the output is whole on every rank and replaces whole rows of the hidden state.

A tower whose head count (or MLP width) does not divide by the ranks is replicated instead
(each rank loads it whole and runs it without a collective), decided per tower at load time and
said in one start-up log line. Either way the tower's projections are read as float tensors
(the DENSE format), as before: quantized VLM checkpoints keep their towers in float, and
--quantize applies to the text decoder only.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence

from pytgi_shard.device.distributed import single_process
from pytgi_shard.quantization.linear_format import DENSE
from pytgi_shard.weights.reader import Weights

log = logging.getLogger(__name__)


def replication_reason(num_heads: int, widths: Sequence[int], world_size: int) -> str | None:
    """Why a tower with `num_heads` heads and column-parallel layers `widths` wide cannot be
    split over `world_size` ranks; None when it can."""
    if world_size == 1:
        return None
    if num_heads % world_size:
        return f"its {num_heads} attention heads do not split over {world_size} ranks"
    uneven = [w for w in widths if w % world_size]
    if uneven:
        return f"its {uneven[0]}-wide MLP does not split over {world_size} ranks"
    return None


def tower_weights(weights: Weights, tower: str, num_heads: int, widths: Sequence[int]) -> Weights:
    """The view of `weights` a tower loads its layers from: float projections, split over the
    ranks of `weights.dist` (the decoder's), or over a world of one (replicated, no collective)
    when replication_reason gives one, which rank 0 logs once."""
    dist = weights.dist
    reason = replication_reason(num_heads, widths, dist.world_size)
    view = copy.copy(weights)
    view.linear_format = DENSE
    if reason is not None:
        if dist.rank == 0:
            log.info("%s vision tower: replicated on each of the %d ranks, not split: %s",
                     tower, dist.world_size, reason)
        view.dist = single_process(dist.device, dist.caps)
    return view

"""Where a rank's slice of a group-quantized weight starts and stops, and why a split is refused.

Column shards cut output features: packed words of outputs (GPTQ's qzeros, AWQ's qweight and
qzeros) must not be cut, so a slice starts and stops on a word. Row shards cut input features:
words of inputs (GPTQ's qweight) must not be cut, nor a quantization group of a weight whose
groups are consecutive (no act-order), so each rank holds its own rows of scales and zeros and
equal groups, which PyTorch's int4 kernel needs. Act-order weights scatter every group over the
inputs; a rank keeps all their scales and zeros and its slice of g_idx (as TGI does), and only
the word alignment applies. A refused split names the --num-shard values that work.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pytgi_shard.quantization.errors import QuantizationError
from pytgi_shard.quantization.linear_weight import OutputPart


def output_range(name: str, out_features: int, part: OutputPart, word: int) -> tuple[int, int]:
    """[start, stop) of output part `part` = (index, parts), on whole words of `word` outputs."""
    index, parts = part
    if out_features % parts:
        raise QuantizationError(
            f"{name} has {out_features} outputs, which do not split into {parts} equal shards"
        )
    block = out_features // parts
    start = index * block
    if block % word:
        raise QuantizationError(
            f"{name}: a shard of {block} of its {out_features} outputs would cut its packed "
            f"words of {word} outputs; serve it with fewer shards (outputs per shard must be a "
            f"multiple of {word})"
        )
    return start, start + block


def is_sorted(g_idx: torch.Tensor) -> bool:
    """Groups are consecutive runs of inputs (no act-order)."""
    return g_idx.numel() < 2 or bool((g_idx[1:] >= g_idx[:-1]).all())


def _row_split_ok(g_idx: torch.Tensor, world: int, word: int) -> bool:
    k = g_idx.numel()
    if k % world or (k // world) % word:
        return False
    if not is_sorted(g_idx) or int(g_idx[-1]) == int(g_idx[0]):
        return True  # act-order, or a single group: no group is a run to keep whole
    bounds = torch.arange(1, world, device=g_idx.device) * (k // world)
    return bool((g_idx[bounds - 1] != g_idx[bounds]).all())


def working_shard_counts(in_features: int, ok: Callable[[int], bool]) -> list[int]:
    """The --num-shard values up to 64 (those that divide the inputs) for which `ok` holds."""
    return [w for w in range(1, 65) if in_features % w == 0 and ok(w)]


def input_range(
    name: str, g_idx: torch.Tensor, rank: int, world: int, word: int
) -> tuple[int, int]:
    """[start, stop) of this rank's input features of a row-parallel weight."""
    if not _row_split_ok(g_idx, world, word):
        k = g_idx.numel()
        works = working_shard_counts(k, lambda w: _row_split_ok(g_idx, w, word))
        shown = ", ".join(str(w) for w in works)
        groups = int(g_idx.max()) + 1 if k else 0
        raise QuantizationError(
            f"--num-shard {world} would cut {name}'s {k} input features inside a packed word "
            f"of {word} or one of its {groups} quantization groups; --num-shard {shown} work"
        )
    block = g_idx.numel() // world
    return rank * block, (rank + 1) * block

"""Per-forward plans: what attention backends derive once from a forward's metadata (index
tensors, masks, split buffers) and every layer of that forward then reuses.

Typed fields, one per backend's need, rather than a string-keyed dict: a plan's type is checked
where it is stored and read. A plan is only valid for the metadata it was derived from, so every
forward builds a new AttentionMetadata (with empty plans) rather than mutating one in place.

The plans' types belong to the backends that build them, and are named here for the type
checker only: a reference group holds the AttentionMetadata of its requests, whose plans hold
groups again (a recursive structure, not a file split by size), so a runtime import either way
would be a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pytgi_shard.attention.reference import ReferenceGroup, ReferenceLayout
    from pytgi_shard.attention.triton_decode import DecodePlan


@dataclass(frozen=True, slots=True)
class MaskKind:
    """Which reference mask: layers of one forward may differ in sliding window (Qwen2's mixed
    layers), and the mask is laid out for the query heads each KV head serves (`group`); with
    ALiBi it is the additive bias of those slopes."""

    sliding_window: int | None
    group: int
    # ALiBi's per-head slopes when the mask carries the bias too (a float mask then).
    alibi: tuple[float, ...] | None = None


@dataclass(frozen=True, slots=True)
class DecodeShape:
    """The head layout a Triton decode plan's partial-result buffers are sized for."""

    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(slots=True)
class AttentionPlans:
    """Filled lazily by the first layer that needs each plan; empty when the metadata is built."""

    # A mixed forward's groups ([] once found not mixed; None: not looked at yet).
    reference_groups: list[ReferenceGroup] | None = None
    reference_layout: ReferenceLayout | None = None
    reference_masks: dict[MaskKind, torch.Tensor] = field(default_factory=dict)
    triton_decode: dict[DecodeShape, DecodePlan] = field(default_factory=dict)

"""config.json as transformers 5 writes it, read through the keys transformers 4 wrote.

Checkpoints saved by transformers >= 5 (new Hub uploads, and any model a user saves with it) keep
RoPE's settings in one `rope_parameters` object instead of the top-level `rope_theta`,
`rope_scaling`, `partial_rotary_factor` (GPT-NeoX's `rotary_pct` and `rotary_emb_base`, which
its reader takes under these names too) and, for Gemma 3, `rope_local_base_freq`; Gemma 3's
object is keyed by layer type. Qwen3-MoE names its expert count `num_local_experts`. The family
readers read the transformers 4 keys, which most published checkpoints still carry, so start-up
maps the newer layout onto them once (`ModelConfig.read`) and every reader sees one layout. A
key the file already has is never overwritten: the mapping only fills what is absent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# rope_parameters' keys that are not part of a rope_scaling object.
_NOT_SCALING = ("rope_theta", "partial_rotary_factor")
# Gemma 3's per-layer-type objects: global layers, and the sliding layers' local base frequency.
_GLOBAL, _LOCAL = "full_attention", "sliding_attention"


def legacy_layout(config: Mapping[str, Any]) -> dict[str, Any]:
    """`config` with transformers 5's renamed keys also present under their transformers 4
    names (a copy; the input is not changed)."""
    out = dict(config)
    rope = config.get("rope_parameters")
    if isinstance(rope, Mapping):
        if isinstance(rope.get(_GLOBAL), Mapping):
            local = rope.get(_LOCAL)
            if isinstance(local, Mapping) and "rope_theta" in local:
                out.setdefault("rope_local_base_freq", local["rope_theta"])
            rope = rope[_GLOBAL]
        _fill_rope(out, rope)
    if config.get("model_type") == "qwen3_moe" and "num_local_experts" in config:
        out.setdefault("num_experts", config["num_local_experts"])
    return out


def _fill_rope(out: dict[str, Any], rope: Mapping[str, Any]) -> None:
    if "rope_theta" in rope:
        out.setdefault("rope_theta", rope["rope_theta"])
    if "partial_rotary_factor" in rope:
        out.setdefault("partial_rotary_factor", rope["partial_rotary_factor"])
    kind = rope.get("rope_type", rope.get("type", "default"))
    scaling = {k: v for k, v in rope.items() if k not in _NOT_SCALING}
    out.setdefault("rope_scaling", None if kind == "default" else scaling)

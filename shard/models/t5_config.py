"""T5's and mT5's config.json, read with transformers' defaults for each (T5Config, MT5Config).

T5 (v1.0) has a ReLU feed-forward and ties its LM head to the shared embedding; T5 v1.1, FLAN-T5
and mT5 have a gated-GELU one ("gated-gelu", which transformers runs as gelu_new, the tanh
approximation) and, mT5 and FLAN-T5 by their configs, an untied head.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# transformers' config defaults for keys a config.json may omit.
_DEFAULTS: Mapping[str, Mapping[str, Any]] = {
    "t5": {
        "d_model": 512, "d_kv": 64, "d_ff": 2048, "num_layers": 6, "num_heads": 8,
        "feed_forward_proj": "relu", "tie_word_embeddings": True,
    },
    "mt5": {
        "d_model": 512, "d_kv": 64, "d_ff": 1024, "num_layers": 8, "num_heads": 6,
        "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False,
        "decoder_start_token_id": 0,
    },
}  # fmt: skip
# T5 has no position limit of its own (relative positions); its checkpoints name 512 (n_positions),
# the length it was trained on, which serves as the default context.
DEFAULT_CONTEXT = 512


@dataclass(frozen=True)
class T5Config:
    model_type: str
    d_model: int
    d_kv: int
    d_ff: int
    num_layers: int
    num_decoder_layers: int
    num_heads: int
    num_buckets: int
    max_distance: int
    eps: float
    # feed_forward_proj "gated-ACT": act(wi_0(x)) * wi_1(x); "ACT": act(wi(x)).
    gated: bool
    activation: str
    tie_word_embeddings: bool
    # The decoder's output times d_model ** -0.5 before the head (T5 v1.0's tied head).
    scale_decoder_outputs: bool
    decoder_start_token_id: int
    max_position_embeddings: int

    @classmethod
    def from_dict(
        cls, raw: Mapping[str, Any], generation: Mapping[str, Any] | None = None
    ) -> T5Config:
        """config.json (`raw`), and generation_config.json's decoder start token when it names one
        (as transformers' generate reads it)."""
        model_type = str(raw["model_type"])
        c = {**_DEFAULTS[model_type], **raw}
        gated, activation = _feed_forward(str(c["feed_forward_proj"]))
        num_layers = int(c["num_layers"])
        return cls(
            model_type=model_type,
            d_model=int(c["d_model"]),
            d_kv=int(c["d_kv"]),
            d_ff=int(c["d_ff"]),
            num_layers=num_layers,
            num_decoder_layers=int(c.get("num_decoder_layers") or num_layers),
            num_heads=int(c["num_heads"]),
            num_buckets=int(c.get("relative_attention_num_buckets", 32)),
            max_distance=int(c.get("relative_attention_max_distance", 128)),
            eps=float(c.get("layer_norm_epsilon", 1e-6)),
            gated=gated,
            activation=activation,
            tie_word_embeddings=bool(c["tie_word_embeddings"]),
            scale_decoder_outputs=_scales_decoder_outputs(c),
            decoder_start_token_id=_decoder_start(c, generation or {}),
            max_position_embeddings=int(c.get("n_positions") or DEFAULT_CONTEXT),
        )

    @classmethod
    def read(cls, raw: Mapping[str, Any], model_path: Path) -> T5Config:
        """from_dict with the directory's generation_config.json, if it has one."""
        path = model_path / "generation_config.json"
        generation = json.loads(path.read_text()) if path.is_file() else {}
        return cls.from_dict(raw, generation if isinstance(generation, dict) else {})


def _feed_forward(proj: str) -> tuple[bool, str]:
    """(gated, activation name) of feed_forward_proj, as T5Config parses it."""
    parts = proj.split("-")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        raise ValueError(
            f"feed_forward_proj {proj!r} is not `gated-ACT` or `ACT` (e.g. 'gated-gelu', 'relu')"
        )
    # transformers' backward compatibility: "gated-gelu" runs the tanh approximation.
    return len(parts) == 2, "gelu_new" if proj == "gated-gelu" else parts[-1]


def _scales_decoder_outputs(c: Mapping[str, Any]) -> bool:
    """transformers 4 scaled exactly when the head was tied to the embedding (T5 v1.0; v1.1,
    FLAN-T5 and mT5 checkpoints say tie_word_embeddings false). transformers 5 ties every head,
    writes T5's choice as scale_decoder_outputs, and never scales mT5."""
    if "scale_decoder_outputs" in c:
        return bool(c["scale_decoder_outputs"])
    written_by = str(c.get("transformers_version") or "4").split(".", 1)[0]
    if written_by.isdigit() and int(written_by) >= 5:
        return False
    return bool(c["tie_word_embeddings"])


def _decoder_start(config: Mapping[str, Any], generation: Mapping[str, Any]) -> int:
    """The decoder's first input: generation_config.json's decoder_start_token_id, else
    config.json's, else the BOS token (transformers' generate falls back to it)."""
    for value in (
        generation.get("decoder_start_token_id"),
        config.get("decoder_start_token_id"),
        generation.get("bos_token_id"),
        config.get("bos_token_id"),
    ):
        if isinstance(value, int):
            return value
    raise ValueError(
        "config.json names no decoder_start_token_id (nor a bos_token_id): an encoder-decoder "
        "needs the token its decoder starts from (T5 uses the pad token, 0)"
    )

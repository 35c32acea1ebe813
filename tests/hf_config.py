"""transformers' config objects read alike under transformers 4 and 5.

transformers 5 keeps RoPE's settings in `rope_parameters` (no `rope_theta` or `rope_scaling`
attribute) and renames a few keys; tests that hold pytgi's config readers to transformers' read
transformers' side through the same key mapping start-up applies to a config.json
(shard/models/config_layout.py, itself tested on literal files of both layouts).
"""

from __future__ import annotations

from typing import Any

import transformers

from pytgi_shard.models.config_layout import legacy_layout

TRANSFORMERS_MAJOR = int(transformers.__version__.split(".", 1)[0])


def hf_fields(config: Any) -> dict[str, Any]:
    """A transformers config object's fields under their transformers 4 names."""
    return legacy_layout(config.to_dict())


# Defaults transformers 5 changed (mT5's head: always tied). pytgi keeps transformers 4's, which
# a file that omits the key was written against: transformers 5 writes every key.
CHANGED_IN_5 = frozenset({("cohere", "rope_theta"), ("mt5", "tie_word_embeddings")})


def compares_default(model_type: str, name: str) -> bool:
    """Whether transformers' default of `name` is the one pytgi's reader must have."""
    return TRANSFORMERS_MAJOR < 5 or (model_type, name) not in CHANGED_IN_5

"""What /info says about the model's identity: the resolved Hub revision and the pipeline tag.

TGI asks the Hub API for both. pytgi reads them from what it already has: the launcher (or a
Hub id resolved through huggingface_hub) serves the model from a Hugging Face cache snapshot,
`.../models--org--name/snapshots/<commit sha>/`, so the folder's name is the revision that was
resolved; and every architecture pytgi serves is a causal LM, the Hub's "text-generation".
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

COMMIT_SHA = re.compile(r"[0-9a-f]{40}")
CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def snapshot_sha(model_file: Path | None) -> str | None:
    """The commit sha of the HF cache snapshot holding `model_file` (not resolving symlinks:
    snapshot files link into `blobs/`), or None for a plain directory."""
    if model_file is None:
        return None
    snapshot = model_file.absolute().parent
    in_cache = snapshot.parent.name == "snapshots" and snapshot.parent.parent.name.startswith(
        "models--"
    )
    return snapshot.name if in_cache and COMMIT_SHA.fullmatch(snapshot.name) else None


def pipeline_tag(config: dict[str, Any] | None) -> str | None:
    """"text-generation" for a causal-LM config.json; None when the config does not say."""
    architectures = (config or {}).get("architectures") or []
    causal = any(isinstance(a, str) and a.endswith(CAUSAL_LM_SUFFIXES) for a in architectures)
    return "text-generation" if causal else None

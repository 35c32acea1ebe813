"""Finding the model's files (a local directory, or a Hub id in the local cache), and what /info
says about the model's identity (its "model card"): the resolved Hub revision and the pipeline tag.

TGI asks the Hub API for both. pytgi reads them from what it already has: the launcher (or a
Hub id resolved through huggingface_hub) serves the model from a Hugging Face cache snapshot,
`.../models--org--name/snapshots/<commit sha>/`, so the folder's name is the revision that was
resolved; and every architecture pytgi serves is a causal LM, the Hub's "text-generation".
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

log = logging.getLogger("pytgi.router")


class ModelFiles:
    """Files of one model repository, found in a directory or through huggingface_hub."""

    def __init__(self, name: str, revision: str | None = None) -> None:
        self.name = name
        self.revision = revision
        path = Path(name).expanduser()
        self.local_dir = path if path.is_dir() else None

    def find(self, filename: str) -> Path | None:
        if self.local_dir is not None:
            candidate = self.local_dir / filename
            return candidate if candidate.is_file() else None
        try:
            from huggingface_hub import hf_hub_download

            return Path(hf_hub_download(self.name, filename, revision=self.revision))
        except Exception as err:  # missing file, no network, bad id: all mean "not there"
            log.debug("%s not found for %s: %s", filename, self.name, err)
            return None

    def read_json(self, filename: str) -> dict[str, Any] | None:
        path = self.find(filename)
        return read_json(path) if path is not None else None

    def tokenizer(self) -> Tokenizer:
        path = self.find("tokenizer.json")
        if path is None:
            raise FileNotFoundError(
                f"no tokenizer.json for {self.name!r}: pass a model directory (or a Hub id "
                "already in the local cache) as --tokenizer-name"
            )
        return Tokenizer.from_file(str(path))


def read_json(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


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

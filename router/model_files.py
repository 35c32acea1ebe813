"""Finding the model's tokenizer files: a local directory, or a Hub id in the local cache."""

from __future__ import annotations

import json
import logging
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

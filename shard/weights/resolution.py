"""Model resolution: a local directory, a weights-cache override, or a Hub snapshot.

Hub models are fetched with huggingface_hub's `snapshot_download` into its cache (safetensors
preferred; `.bin` only when a repository has no safetensors, then converted once). Offline
(HF_HUB_OFFLINE=1, or no network) a cached snapshot is used; with none, the error names the model
and the cache path. Used by the launcher before it starts anything, and by `pytgi-shard
download-weights` (shard/weights/download.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pytgi_shard.weights.conversion import (
    ConversionError,
    bin_weights,
    convert_directory,
    has_safetensors,
)

log = logging.getLogger(__name__)

# Everything a server needs besides weights: configs, tokenizer files, chat templates.
METADATA_PATTERNS = ["*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken", "tokenizer*"]


class ModelNotFound(Exception):
    """The model cannot be resolved; the message is one line a user can act on."""


@dataclass(frozen=True, slots=True)
class WeightsSource:
    model_id: str
    revision: str | None = None
    huggingface_hub_cache: str | None = None
    weights_cache_override: str | None = None
    # None: huggingface_hub decides (HF_HUB_OFFLINE); True: only the local cache.
    offline: bool | None = None
    # Config and tokenizer files only (what a router needs), no weights.
    metadata_only: bool = False
    # None: huggingface_hub's own (HF_TOKEN or the saved login).
    token: str | None = field(default=None, repr=False)


def resolve_model(source: WeightsSource) -> Path:
    """A local directory holding config, tokenizer and safetensors weights for `source`."""
    if source.weights_cache_override:
        override = Path(source.weights_cache_override).expanduser()
        return prepare_local(override, "--weights-cache-override", source.metadata_only)
    local = Path(source.model_id).expanduser()
    if local.is_dir():
        return prepare_local(local, "model directory", source.metadata_only)
    if _looks_like_path(source.model_id):
        raise ModelNotFound(f"model directory {source.model_id} does not exist")
    return download_model(source)


def _looks_like_path(model_id: str) -> bool:
    return model_id.startswith(("/", "./", "../", "~")) or model_id.count("/") > 1


def prepare_local(path: Path, what: str, metadata_only: bool = False) -> Path:
    if not path.is_dir():
        raise ModelNotFound(f"{what} {path} does not exist")
    if not (path / "config.json").is_file():
        raise ModelNotFound(f"{what} {path} has no config.json: not a Hugging Face model folder")
    if not metadata_only:
        _ensure_safetensors(path)
    return path


def _ensure_safetensors(path: Path) -> None:
    if has_safetensors(path):
        return
    if not bin_weights(path):
        raise ModelNotFound(f"{path} holds no *.safetensors or pytorch_model*.bin weights")
    try:
        convert_directory(path)
    except ConversionError as e:
        raise ModelNotFound(str(e)) from e


def hub_cache_dir(source: WeightsSource) -> str:
    from huggingface_hub import constants

    return source.huggingface_hub_cache or constants.HF_HUB_CACHE


def download_model(source: WeightsSource) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    name = source.model_id + (f"@{source.revision}" if source.revision else "")
    cache = hub_cache_dir(source)

    def fetch(weights: str) -> Path:
        log.info("resolving %s (%s) in %s", name, weights, cache)
        return Path(snapshot_download(
            source.model_id, revision=source.revision, cache_dir=source.huggingface_hub_cache,
            allow_patterns=[*METADATA_PATTERNS, weights], local_files_only=bool(source.offline),
            token=source.token,
        ))

    try:
        if source.metadata_only:
            path = fetch("config.json")
        else:
            path = fetch("*.safetensors")
            if not has_safetensors(path):
                path = fetch("*.bin")
    except (GatedRepoError, RepositoryNotFoundError) as e:
        raise ModelNotFound(f"model {name} is not on the Hub or needs a token (HF_TOKEN): "
                            f"{_first_line(e)}") from e
    except RevisionNotFoundError as e:
        raise ModelNotFound(f"model {name}: revision not found on the Hub") from e
    except LocalEntryNotFoundError as e:
        raise ModelNotFound(
            f"model {name} is not in the Hugging Face cache at {cache} and the Hub cannot be "
            "reached (offline): download it once with network access, or point --model-id at "
            "a local directory") from e
    except (HfHubHTTPError, OSError) as e:
        raise ModelNotFound(f"model {name}: download into {cache} failed: {_first_line(e)}") from e
    return prepare_local(path, f"snapshot of {name}", source.metadata_only)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def hub_token(env: Mapping[str, str]) -> str | None:
    """HF_TOKEN, or TGI's older HF_API_TOKEN; None lets huggingface_hub use a saved login."""
    return env.get("HF_TOKEN") or env.get("HF_API_TOKEN") or None

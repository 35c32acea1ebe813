"""One-time conversion of PyTorch `.bin` checkpoints to safetensors, without unpickling code.

`torch.load(weights_only=True)` refuses any pickle that would import or call arbitrary code, so a
malicious checkpoint fails here instead of running. Converted files sit next to the originals
(`pytorch_model-00001-of-00002.bin` -> `model-00001-of-00002.safetensors`), so the next start finds
safetensors and converts nothing.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

BIN_INDEX = "pytorch_model.bin.index.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"


class ConversionError(Exception):
    """A `.bin` checkpoint that cannot be converted (unsafe pickle, unwritable directory...)."""


def has_safetensors(path: Path) -> bool:
    return any(path.glob("*.safetensors"))


def bin_weights(path: Path) -> list[Path]:
    """The checkpoint's `.bin` files: those its index names, else `pytorch_model*.bin`."""
    index = path / BIN_INDEX
    if index.is_file():
        names = set(json.loads(index.read_text())["weight_map"].values())
        return sorted(path / name for name in names)
    return sorted(path.glob("pytorch_model*.bin"))


def safetensors_name(bin_name: str) -> str:
    stem = bin_name.removesuffix(".bin")
    if stem.startswith("pytorch_model"):
        stem = "model" + stem.removeprefix("pytorch_model")
    return stem + ".safetensors"


def convert_directory(path: Path) -> list[Path]:
    """Converts every `.bin` weight file of `path` that has no safetensors twin; returns new files."""
    written = []
    for src in bin_weights(path):
        dst = path / safetensors_name(src.name)
        if dst.exists():
            continue
        log.info("converting %s to %s (once)", src.name, dst.name)
        convert_file(src, dst)
        written.append(dst)
    index = path / BIN_INDEX
    if index.is_file() and not (path / SAFETENSORS_INDEX).exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {k: safetensors_name(v) for k, v in data["weight_map"].items()}
        _write_atomically(path / SAFETENSORS_INDEX, json.dumps(data, indent=2).encode())
    return written


def convert_file(src: Path, dst: Path) -> None:
    import torch
    from safetensors.torch import save_file

    try:
        state = _load_weights_only(src)
    except Exception as e:
        raise ConversionError(f"cannot load {src} safely (weights only): {e}") from e
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConversionError(f"{src} does not hold a flat name -> tensor state dict")
    tmp = dst.with_name(dst.name + ".partial")
    try:
        save_file(_unshared(state), str(tmp), metadata={"format": "pt"})
        os.replace(tmp, dst)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ConversionError(f"cannot write {dst}: {e}") from e


def _load_weights_only(src: Path) -> object:
    import torch

    try:
        # mmap keeps a large checkpoint out of memory; files older than torch 1.6's zip format
        # cannot be mapped, only read.
        return torch.load(src, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise
        return torch.load(src, map_location="cpu", weights_only=True)


def _unshared(state: dict) -> dict:
    """safetensors refuses tensors that share storage (tied embeddings): each gets its own copy."""
    seen: set[int] = set()
    out = {}
    for name, tensor in state.items():
        ptr = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone().contiguous() if ptr in seen else tensor.contiguous()
        seen.add(ptr)
    return out


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".partial")
    tmp.write_bytes(data)
    os.replace(tmp, path)

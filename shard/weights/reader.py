"""Reads a checkpoint's safetensors, each rank only its own slice of every sharded tensor."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pytgi_shard.device.distributed import Dist
from pytgi_shard.quantization.errors import QuantizationError
from pytgi_shard.quantization.linear_format import DENSE, LinearFormat
from pytgi_shard.quantization.linear_weight import LinearLoader, LinearWeight

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Weight formats that are Python pickles: loading one can run any code its author put in it.
PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt")


def find_weight_files(model_path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those its index names, else model.safetensors,
    else every *.safetensors (Hub repos may also hold other formats' files, like Mistral's
    consolidated.safetensors, which only the index or the single-file name tells apart)."""
    index = model_path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise ValueError(f"{index} is not a valid safetensors index: {e}") from e
        files = [model_path / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} names files that do not exist: {', '.join(missing)}")
        return files
    if (model_path / SINGLE_FILE).is_file():
        return [model_path / SINGLE_FILE]
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise ValueError(_no_safetensors(model_path))
    return files


def _no_safetensors(model_path: Path) -> str:
    pickles = sorted(p.name for pattern in PICKLE_PATTERNS for p in model_path.glob(pattern))
    if not pickles:
        return f"no safetensors weights in {model_path} (only safetensors are loaded)"
    shown = ", ".join(pickles[:3]) + (", ..." if len(pickles) > 3 else "")
    return (
        f"{model_path} holds only pickled PyTorch weights ({shown}): the shard loads safetensors "
        "only, because unpickling a file can run code hidden in it. Convert them once with "
        f"`pytgi-shard download-weights {model_path}` (weights-only loading, which refuses "
        "code), or start through pytgi-launcher, which does the same"
    )


class Weights:
    """Tensor name -> file map of a checkpoint, with readers that cast and place on this rank.

    Floating tensors are cast to `dtype`; integers are never cast. 8-bit floats (FP8
    checkpoints' weights) only mean something with their scales: they are read as stored by the
    FP8 loader (`cast=False`) and refused where a model reads a float weight, never cast.
    Every tensor lands on `dist.device`. Sharded readers read only this rank's slice from disk
    (safetensors slices are lazy). `linear_format` says how the checkpoint's linear weights are
    read (dense, pre-quantized, or quantized as they load).
    """

    def __init__(
        self,
        model_path: Path,
        dtype: torch.dtype,
        dist: Dist,
        linear_format: LinearFormat = DENSE,
    ) -> None:
        self.model_path = model_path
        self.dtype = dtype
        self.dist = dist
        self.linear_format = linear_format
        self._handles: dict[Path, Any] = {}
        self._routing: dict[str, Path] = {}
        # Names a view reads as another stored tensor (with_names); empty for the checkpoint.
        self._stored: dict[str, str] = {}
        for file in find_weight_files(model_path):
            for name in self._handle(file).keys():  # noqa: SIM118 (safe_open is no mapping)
                if name in self._routing:
                    raise ValueError(
                        f"tensor {name!r} is in both {self._routing[name].name} and {file.name}"
                    )
                self._routing[name] = file

    def with_dtype(self, dtype: torch.dtype) -> Weights:
        """The same checkpoint read into `dtype` (a module a model keeps in another precision,
        as T5 keeps wo in float32 under float16): the files' handles and the name map are
        shared, not opened and scanned again, and close with these."""
        view = copy.copy(self)
        view.dtype = dtype
        return view

    def with_names(self, stored: Mapping[str, str]) -> Weights:
        """The same checkpoint with extra names, each read as the stored tensor it maps to: a
        vision-language checkpoint's text half (`language_model.model.*`) read under the names
        the text decoder loads (`model.*`). Handles are shared and close with these, as
        with_dtype's."""
        view = copy.copy(self)
        view._stored = {**self._stored, **stored}
        view._routing = {**self._routing,
                         **{alias: self._file(name) for alias, name in stored.items()}}
        return view

    def _slice(self, name: str) -> Any:
        return self._handle(self._file(name)).get_slice(self._stored.get(name, name))

    def _handle(self, file: Path) -> Any:
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise ValueError(f"cannot read {file}: {e}") from e
        return self._handles[file]

    def _file(self, name: str) -> Path:
        if name not in self._routing:
            raise ValueError(f"weight {name!r} not found in the checkpoint at {self.model_path}")
        return self._routing[name]

    def __contains__(self, name: object) -> bool:
        return name in self._routing

    def names(self) -> list[str]:
        return sorted(self._routing)

    def shape(self, name: str) -> list[int]:
        return list(self._slice(name).get_shape())

    @property
    def linear_loader(self) -> LinearLoader:
        """Reads projections stored one per name (ColumnParallelLinear / RowParallelLinear)."""
        return self.linear_format.loader

    def linear_from_float(self, weight: torch.Tensor) -> LinearWeight:
        """A float weight a model assembled in its own layout (a fused q|k|v cut by heads, a
        transposed Conv1D), as its layer holds it: quantized on load when asked."""
        return self.linear_format.from_float(weight)

    def dtype_name(self, name: str) -> str:
        """The stored dtype of `name` as safetensors spells it ("F8_E4M3", "BF16", "I32")."""
        return str(self._slice(name).get_dtype())

    def _place(self, name: str, t: torch.Tensor, cast: bool) -> torch.Tensor:
        if cast and t.is_floating_point():
            if t.element_size() == 1:
                raise QuantizationError(
                    f"{name!r} is stored in 8-bit floating point ({t.dtype}) and is read here as "
                    "a model weight: cast, it would lose the scale that gives it its value. "
                    "pytgi reads FP8 weights only in the linear projections of FP8 checkpoints"
                )
            t = t.to(self.dtype)
        return t.to(self.dist.device)

    def get_tensor(self, name: str, *, cast: bool = True) -> torch.Tensor:
        """The whole tensor (replicated weights: norms, unsharded heads). `cast=False` keeps
        the stored dtype (quantization scales, whose precision the kernels rely on)."""
        stored = self._stored.get(name, name)
        return self._place(name, self._handle(self._file(name)).get_tensor(stored), cast)

    def get_range(
        self, name: str, dim: int, start: int, stop: int, *, cast: bool = True
    ) -> torch.Tensor:
        """Rows start:stop of `name` along `dim`, read from disk without the rest."""
        shape = self.shape(name)
        dim = dim % len(shape)
        index = tuple(slice(start, stop) if d == dim else slice(None) for d in range(len(shape)))
        return self._place(name, self._slice(name)[index], cast)

    def get_part(
        self, name: str, dim: int, index: int, parts: int, *, cast: bool = True
    ) -> torch.Tensor:
        """Part `index` of `parts` equal parts of `name` along `dim`."""
        size = self.shape(name)[dim]
        if size % parts != 0:
            raise ValueError(
                f"weight {name!r} has {size} rows along dim {dim}, which do not split into "
                f"{parts} equal shards"
            )
        block = size // parts
        return self.get_range(name, dim, index * block, (index + 1) * block, cast=cast)

    def get_sharded(self, name: str, dim: int, *, cast: bool = True) -> torch.Tensor:
        """This rank's 1/world_size slice of `name` along `dim`."""
        return self.get_part(name, dim, self.dist.rank, self.dist.world_size, cast=cast)

    def close(self) -> None:
        """Drops the file handles (and their memory maps) once the model is built."""
        self._handles.clear()

"""The LinearLoader of FP8 checkpoints (quant_method fp8, fbgemm_fp8, compressed-tensors FP8).

Layout of a quantized linear `prefix`, the same in all three:
  weight        float8_e4m3fn [out, in]
  weight_scale  float32 (or bf16/fp16) [] or [1] per tensor, [out] or [out, 1] per output row
  input_scale   float32 [] or [1], only with static activation scales
and W = weight * weight_scale (each row by its scale). The payload is read as stored, never cast
(CheckpointTensors keeps 8-bit floats; a cast would drop the scale's meaning), the scales are read in their
stored precision and widened to float32 (exact), so the loaded layer's dequantize() equals the
checkpoint's W bit for bit in float32. A projection stored in float (compressed-tensors' `ignore`,
fp8's ignored_layers, lm_head) is read dense: the stored dtype decides, no name matching.

Sharding: a column-parallel rank takes its output rows of the weight and of per-row scales; a
row-parallel rank its input columns, every row scale whole. Fused projections (q|k|v, gate|up)
with different per-tensor scales are kept exact with per-output-row scales (each part's rows
carry its scale) rather than requantized to a shared scale, which would round every weight a
second time; when all parts share one scale it stays one per-tensor scale. Their static
input_scales become the largest of them (as TGI and vLLM do): no activation clips.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pytgi_shard.quantization.checkpoint_tensors import CheckpointTensors
from pytgi_shard.quantization.dense_loader import DenseLoader
from pytgi_shard.quantization.errors import QuantizationError
from pytgi_shard.quantization.linear_weight import LinearWeight, OutputPart, QuantizedWeight

FP8_DTYPE = "F8_E4M3"
# (weight float8_e4m3fn [out, in], scale float32 [] or [out], input_scale float32 [] or None)
Fp8Maker = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], QuantizedWeight]


class Fp8CheckpointLoader:
    """Reads FP8 projections with their scales and hands them to `make` (the FP8 kernel's
    weight class); float projections go through the dense loader."""

    def __init__(self, make: Fp8Maker) -> None:
        self.make = make
        self.dense = DenseLoader()

    def column(
        self, weights: CheckpointTensors, prefixes: Sequence[str], parts: Sequence[OutputPart]
    ) -> LinearWeight:
        if not _stored_fp8(weights, prefixes):
            return self.dense.column(weights, prefixes, parts)
        pieces, scales = [], []
        for prefix, (index, count) in zip(prefixes, parts, strict=True):
            piece = weights.get_part(f"{prefix}.weight", 0, index, count, cast=False)
            pieces.append(piece)
            scales.append(_row_scales(weights, prefix, (index, count), piece.shape[0]))
        weight = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        rows = [piece.shape[0] for piece in pieces]
        return self.make(weight, _shared(scales, rows), _input_scale(weights, prefixes))

    def row(self, weights: CheckpointTensors, prefix: str) -> LinearWeight:
        if not _stored_fp8(weights, [prefix]):
            return self.dense.row(weights, prefix)
        weight = weights.get_sharded(f"{prefix}.weight", dim=1, cast=False)
        scale = _row_scales(weights, prefix, (0, 1), weight.shape[0])
        return self.make(weight, scale, _input_scale(weights, [prefix]))


def _stored_fp8(weights: CheckpointTensors, prefixes: Sequence[str]) -> bool:
    """True when every projection's weight is stored in FP8, False when none is."""
    stored = [weights.dtype_name(f"{p}.weight") == FP8_DTYPE for p in prefixes]
    if all(stored):
        return True
    if not any(stored):
        return False
    raise QuantizationError(
        f"{', '.join(prefixes)} are fused into one matmul but only some are stored in FP8"
    )


def _row_scales(weights: CheckpointTensors, prefix: str, part: OutputPart, rows: int) -> torch.Tensor:
    """float32 [] for a per-tensor scale, else this part's [rows] per-row scales."""
    name = f"{prefix}.weight_scale"
    if name not in weights:
        raise QuantizationError(f"FP8 weight {prefix}.weight has no {name} in the checkpoint")
    shape = weights.shape(name)
    numel = 1
    for size in shape:
        numel *= size
    if numel == 1:
        return weights.get_tensor(name, cast=False).float().reshape(())
    out_features = weights.shape(f"{prefix}.weight")[0]
    if shape not in ([out_features], [out_features, 1]):
        raise QuantizationError(
            f"{name} has shape {shape}: pytgi reads FP8 scales per tensor ([] or [1]) or per "
            f"output row ([{out_features}] or [{out_features}, 1]), not block-wise"
        )
    index, count = part
    scale = weights.get_part(name, 0, index, count, cast=False).float().reshape(-1)
    assert scale.shape[0] == rows
    return scale


def _shared(scales: list[torch.Tensor], rows: list[int]) -> torch.Tensor:
    """One scale for the fused weight whose parts have `rows` rows each: per-tensor when every
    part has the same per-tensor scale, else per output row (exact; see the module docstring)."""
    first = scales[0]
    if all(s.dim() == 0 and torch.equal(s, first) for s in scales):
        return first
    return torch.cat(
        [s.expand(n) if s.dim() == 0 else s for s, n in zip(scales, rows, strict=True)]
    )


def _input_scale(weights: CheckpointTensors, prefixes: Sequence[str]) -> torch.Tensor | None:
    """The static activation scale (largest of the fused parts'), None when none is stored."""
    names = [f"{p}.input_scale" for p in prefixes]
    present = [n for n in names if n in weights]
    if not present:
        return None
    if len(present) != len(names):
        raise QuantizationError(f"only some of {', '.join(names)} are in the checkpoint")
    stored = [weights.get_tensor(n, cast=False).float().reshape(-1) for n in present]
    return torch.cat(stored).max().reshape(())

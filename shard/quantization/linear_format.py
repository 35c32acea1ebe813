"""How a checkpoint's linear weights become what the parallel linears hold: the Weights of a
checkpoint carry one LinearFormat.

Two ways in. Projections named by prefix (q_proj, gate_proj, o_proj, ...) are read by the
`loader` (dense `.weight`, GPTQ's qweight/scales/qzeros, FP8 weights with their scales). A model
that reads a layer in its own layout (a fused q|k|v tensor cut by heads, GPT-2's transposed
Conv1D) assembles a float weight itself and hands it to `from_float`: kept as it is, quantized
under --quantize eetq/bitsandbytes/fp8, refused for a pre-quantized checkpoint, whose tensors
are no float weight at all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pytgi_shard.quantization.dense_loader import DenseLoader, keep_float
from pytgi_shard.quantization.errors import QuantizationError
from pytgi_shard.quantization.linear_weight import LinearLoader, LinearWeight


@dataclass(frozen=True)
class LinearFormat:
    # What /info and the logs call it: "" for float weights, else the method ("gptq", "fp8").
    name: str = ""
    loader: LinearLoader = field(default_factory=DenseLoader)
    from_float: Callable[[torch.Tensor], LinearWeight] = keep_float


DENSE = LinearFormat()


def quantized_on_load(name: str, quantize: Callable[[torch.Tensor], LinearWeight]) -> LinearFormat:
    """Float checkpoint, each linear quantized by `quantize` as soon as its weight is read."""
    return LinearFormat(name, DenseLoader(quantize), quantize)


def pre_quantized_format(name: str, loader: LinearLoader) -> LinearFormat:
    """A checkpoint stored quantized: read by `loader`; no layer may be read as a float weight."""

    def refuse(weight: torch.Tensor) -> LinearWeight:
        raise QuantizationError(
            f"this {name} checkpoint has a layer ({list(weight.shape)}) that the model reads as "
            f"a float tensor in its own layout: pytgi reads {name} weights only for projections "
            "stored one per name (q_proj, k_proj, v_proj, o_proj, gate/up/down_proj)"
        )

    return LinearFormat(name, loader, refuse)

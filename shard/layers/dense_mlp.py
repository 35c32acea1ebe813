"""The plain two-layer feed-forward block (GPT-2, OPT, BLOOM, NeoX, Falcon, MPT), tensor-parallel.

    down(act(up(x)))

up is column-parallel (each rank a slice of the intermediate features), down row-parallel (the
partial sums all-reduced), as in the gated MLP but without a gate.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import nn

from pytgi_shard.layers.linear import ColumnParallelLinear, RowParallelLinear
from pytgi_shard.weights import Weights


def _tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# transformers' activation names (config hidden_act / activation_function) as the checkpoints use
# them; gelu_new, gelu_fast and BLOOM's gelu are all the tanh approximation.
DENSE_ACTIVATIONS: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] = MappingProxyType({
    "gelu": F.gelu,
    "gelu_new": _tanh_gelu,
    "gelu_fast": _tanh_gelu,
    "gelu_pytorch_tanh": _tanh_gelu,
    "relu": F.relu,
    "silu": F.silu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
})


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in DENSE_ACTIVATIONS:
        supported = ", ".join(DENSE_ACTIVATIONS)
        raise ValueError(f"activation {name!r} is not supported (supported: {supported})")
    return DENSE_ACTIVATIONS[name]


class DenseMLP(nn.Module):
    def __init__(
        self,
        up: ColumnParallelLinear,
        down: RowParallelLinear,
        act: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        super().__init__()
        self.up = up
        self.down = down
        self.act = act

    @classmethod
    def load(
        cls, weights: Weights, up: str, down: str, act: str, bias: bool = True
    ) -> DenseMLP:
        """From nn.Linear checkpoints named `up` and `down` (prefixes of .weight/.bias)."""
        return cls(
            ColumnParallelLinear.load(weights, up, bias),
            RowParallelLinear.load(weights, down, bias),
            activation(act),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))

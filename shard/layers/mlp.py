"""The feed-forward blocks, tensor-parallel: gated (SwiGLU in the Llama family, GeGLU in Gemma;
gate and up as two tensors or Phi-3's fused gate_up_proj) and plain, down(act(up(x))) (StarCoder2,
GPT-2, OPT, BLOOM, NeoX, Falcon, MPT). up is column-parallel (each rank a slice of the
intermediate features), down row-parallel (the partial sums all-reduced)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import nn

from pytgi_shard.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    load_fused_column,
)
from pytgi_shard.weights.reader import Weights


def _tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# transformers' activation names (config hidden_act / activation_function) as checkpoints use
# them; gelu_new, gelu_fast and gelu_pytorch_tanh are all the tanh approximation.
ACTIVATIONS: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] = MappingProxyType({
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_new": _tanh_gelu,
    "gelu_fast": _tanh_gelu,
    "gelu_pytorch_tanh": _tanh_gelu,
    "relu": F.relu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
})


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(
            f"activation {name!r} is not supported (supported: {', '.join(ACTIVATIONS)})"
        )
    return ACTIVATIONS[name]


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); gate and up fused in one column-parallel matmul."""

    def __init__(
        self,
        gate_up: ColumnParallelLinear,
        down: RowParallelLinear,
        act: Callable[[torch.Tensor], torch.Tensor],
        kernel_act: str | None = None,
    ) -> None:
        super().__init__()
        self.gate_up = gate_up
        self.down = down
        self.act = act
        # The activation's name when the fused Triton kernel computes act(gate) * up.
        self.kernel_act = kernel_act

    @classmethod
    def load(
        cls, weights: Weights, prefix: str, hidden_act: str, bias: bool, fused: bool = False
    ) -> GatedMLP:
        """gate_proj and up_proj of `prefix`, or its fused gate_up_proj when `fused`."""
        act = activation(hidden_act)
        if fused:
            gate_up = load_fused_column(weights, f"{prefix}.gate_up_proj", 2, bias)
        else:
            gate_up = ColumnParallelLinear.load_packed(
                weights, [f"{prefix}.gate_proj", f"{prefix}.up_proj"], bias
            )
        down = RowParallelLinear.load(weights, f"{prefix}.down_proj", bias)
        kernel_act = None
        if weights.dist.caps.triton_kernels:
            from pytgi_shard.layers.triton_activation import KERNEL_ACTIVATIONS

            # An activation the kernel lacks (relu, quick_gelu) stays on the eager path.
            kernel_act = hidden_act if hidden_act in KERNEL_ACTIVATIONS else None
        return cls(gate_up, down, act, kernel_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        if self.kernel_act is not None and gate_up.dim() == 2:
            from pytgi_shard.layers.triton_activation import gated_activation

            return self.down(gated_activation(gate_up, self.kernel_act))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


class PlainMLP(nn.Module):
    """down(act(up(x))), no gate: up column-, down row-parallel."""

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
        cls, weights: Weights, up: str, down: str, hidden_act: str, bias: bool = True
    ) -> PlainMLP:
        """From nn.Linear checkpoints: `up` and `down` are the two projections' full names
        (c_fc and c_proj in StarCoder2), prefixes of .weight/.bias."""
        return cls(
            ColumnParallelLinear.load(weights, up, bias),
            RowParallelLinear.load(weights, down, bias),
            activation(hidden_act),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))

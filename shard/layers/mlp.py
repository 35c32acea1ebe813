"""The gated feed-forward block (SwiGLU in the Llama family), tensor-parallel."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import nn

from pytgi_shard.layers.layernorm import triton_kernels_on
from pytgi_shard.layers.linear import ColumnParallelLinear, RowParallelLinear
from pytgi_shard.weights import Weights

ACTIVATIONS: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] = MappingProxyType({
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
})


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
    def load(cls, weights: Weights, prefix: str, hidden_act: str, bias: bool) -> GatedMLP:
        if hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"activation {hidden_act!r} is not supported (supported: {', '.join(ACTIVATIONS)})"
            )
        gate_up = ColumnParallelLinear.load_packed(
            weights, [f"{prefix}.gate_proj", f"{prefix}.up_proj"], bias
        )
        down = RowParallelLinear.load(weights, f"{prefix}.down_proj", bias)
        kernel_act = hidden_act if triton_kernels_on(weights.dist.device) else None
        return cls(gate_up, down, ACTIVATIONS[hidden_act], kernel_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        if self.kernel_act is not None and gate_up.dim() == 2:
            from pytgi_shard.layers.triton_activation import gated_activation

            return self.down(gated_activation(gate_up, self.kernel_act))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down(self.act(gate) * up)

"""The sparse mixture-of-experts block of Mixtral, Qwen2-MoE and Qwen3-MoE, tensor-parallel.

    routing = route(x @ gate^T)                      every rank, whole (moe_routing.py)
    y = sum over each token's k experts of w * down(act(gate(x)) * up(x))
    y += sigmoid(x @ shared_gate^T) * shared(x)      Qwen2-MoE's shared expert
    return all_reduce(y)                             one all-reduce per block

The experts run grouped by expert, never per token: the grouped PyTorch path (grouped_experts.py)
on the CPU, two Triton grouped GEMMs (triton_grouped_gemm.py) on CUDA. The Triton path keeps
every shape fixed and every index on the device, so a decode step stays CUDA-graph capturable; the
grouped PyTorch path reads its group sizes on the host and is not (`capturable` says which runs).

Sharding: each expert's MLP is split column/row-parallel over the ranks ("tp" in
expert_partition.py), rather than expert parallelism ("ep": rank r holding E / world experts
whole). Both hold 1/world of the weights and need the same single all-reduce of [tokens, hidden]
(the block's input is replicated on every rank, so ep needs no all-to-all here); they differ in
balance. With tp every rank does 1/world of every chosen expert whatever the routing; with ep a
step waits for the rank that holds most of the chosen experts. Measured on the CPU
(bench/experiments/moe_sharding.py, bench/results/cpu/moe.json; each rank's share timed alone, the slower
rank per input), a Mixtral-like block at batch 1 takes 0.76 ms on the busier tp rank against
1.24 ms with ep, and the same at batch 64 (8.9 / 9.3 ms); 64 small experts top-8 are even at
batch 1 and 20% faster with ep at batch 64 (6.3 / 7.7 ms: whole experts make wider matmuls).
Two real gloo processes on the same busy 2 cores measure within noise of each other, the
all-reduce dominating. On a GPU a decode step is bound by reading expert weights, and there the
imbalance grows with the ranks: per decode token, the busiest rank reads 1.64 experts' weights
with ep against 1.0 with tp on 2 ranks (8 experts top-2), and on 8 ranks a whole expert against
a quarter of one (4x; 64 experts top-8: 2.4x). ep's wider GEMMs could pay only at prefill
sizes, which are compute-bound and where routing evens out over many tokens. tp also serves expert counts that do not divide
by the number of ranks (Qwen1.5-MoE's 60 experts over 8 GPUs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pytgi_shard.device.distributed import Dist
from pytgi_shard.layers.expert_partition import (
    ExpertNames,
    ExpertPartition,
    Sharding,
    load_stacked_experts,
)
from pytgi_shard.layers.grouped_experts import grouped_experts
from pytgi_shard.layers.linear import ColumnParallelLinear
from pytgi_shard.layers.mlp import activation
from pytgi_shard.layers.moe_routing import route
from pytgi_shard.weights.reader import Weights


@dataclass(frozen=True)
class MoESpec:
    """A family's sparse blocks, as its config.json describes them."""

    num_experts: int
    top_k: int
    # Each routed expert's intermediate size (Mixtral's intermediate_size, Qwen's
    # moe_intermediate_size).
    intermediate_size: int
    # Divide the top-k weights by their sum (Mixtral; Qwen's norm_topk_prob).
    renormalize: bool
    # Whether each layer's MLP is a sparse block (else a dense MLP of the decoder's
    # intermediate_size: Qwen's decoder_sparse_step and mlp_only_layers).
    sparse_layers: tuple[bool, ...]
    # The block's name in a layer (Mixtral: block_sparse_moe; Qwen: mlp) and its experts'.
    module: str
    names: ExpertNames
    # Qwen2-MoE's shared expert's intermediate size; 0: no shared expert.
    shared_intermediate_size: int = 0


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert, scaled by sigmoid(shared_expert_gate(x)): a gated MLP split
    like a dense one, left un-reduced so the block's one all-reduce completes it too."""

    def __init__(
        self, gate_up: ColumnParallelLinear, down: torch.Tensor, gate: torch.Tensor
    ) -> None:
        super().__init__()
        self.gate_up = gate_up
        self.down = nn.Parameter(down, requires_grad=False)
        self.gate = nn.Parameter(gate, requires_grad=False)

    @classmethod
    def load(cls, weights: Weights, prefix: str) -> SharedExpert:
        expert = f"{prefix}.shared_expert"
        gate_up = ColumnParallelLinear.load_packed(
            weights, [f"{expert}.gate_proj", f"{expert}.up_proj"], bias=False
        )
        down = weights.get_sharded(f"{expert}.down_proj.weight", dim=1)
        return cls(gate_up, down, weights.get_tensor(f"{prefix}.shared_expert_gate.weight"))

    def partial(
        self, x: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """This rank's share of sigmoid(gate(x)) * down(act(gate_proj(x)) * up_proj(x))."""
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        out = F.linear(act(gate) * up, self.down)
        return torch.sigmoid(F.linear(x, self.gate)) * out


class SparseMoE(nn.Module):
    """One layer's sparse block on this rank: the replicated router, this rank's part of the
    experts (stacked [experts, ...] per projection), the shared expert's slice if any; its
    forward returns the whole block's output (all-reduced)."""

    def __init__(
        self,
        spec: MoESpec,
        gate: torch.Tensor,
        experts: tuple[torch.Tensor, torch.Tensor],
        partition: ExpertPartition,
        hidden_act: str,
        shared: SharedExpert | None,
        dist: Dist,
    ) -> None:
        super().__init__()
        self.top_k = spec.top_k
        self.renormalize = spec.renormalize
        self.gate = nn.Parameter(gate, requires_grad=False)
        self.gate_up = nn.Parameter(experts[0], requires_grad=False)
        self.down = nn.Parameter(experts[1], requires_grad=False)
        self.partition = partition
        self.act = activation(hidden_act)
        self.shared = shared
        self.dist = dist
        # The Triton grouped GEMMs (CUDA), else the grouped PyTorch path; the fused activation
        # kernel's name when it computes act(gate) * up there.
        self.triton = dist.caps.triton_kernels
        self.kernel_act: str | None = None
        if self.triton:
            from pytgi_shard.layers.triton_activation import KERNEL_ACTIVATIONS

            # An activation the kernel lacks stays eager between the two GEMMs.
            self.kernel_act = hidden_act if hidden_act in KERNEL_ACTIVATIONS else None

    @property
    def capturable(self) -> bool:
        """Whether the forward can be captured in a CUDA graph (no host synchronisation)."""
        return self.triton

    @classmethod
    def load(
        cls,
        weights: Weights,
        prefix: str,
        spec: MoESpec,
        hidden_act: str,
        sharding: Sharding = "tp",
    ) -> SparseMoE:
        partition = ExpertPartition.of(sharding, spec.num_experts, weights.dist)
        experts = load_stacked_experts(weights, prefix, spec.names, partition)
        shared = SharedExpert.load(weights, prefix) if spec.shared_intermediate_size else None
        gate = weights.get_tensor(f"{prefix}.gate.weight")
        return cls(spec, gate, experts, partition, hidden_act, shared, weights.dist)

    def _activation(self, h: torch.Tensor) -> torch.Tensor:
        """act(gate) * up of the grouped GEMM's [rows, 2 * inter] output."""
        if self.kernel_act is not None:
            from pytgi_shard.layers.triton_activation import gated_activation

            return gated_activation(h, self.kernel_act)
        gate, up = h.chunk(2, dim=-1)
        return self.act(gate) * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing = route(F.linear(x, self.gate), self.top_k, self.renormalize, x.dtype)
        experts = self.partition.local(routing.experts)
        if self.triton:
            from pytgi_shard.layers.triton_grouped_gemm import triton_experts

            out = triton_experts(
                x, experts, routing.weights, self.gate_up, self.down, self._activation
            )
        else:
            out = grouped_experts(
                x, experts, routing.weights, self.gate_up, self.down, self.act
            )
        if self.shared is not None:
            out = out + self.shared.partial(x, self.act)
        return self.dist.all_reduce(out)

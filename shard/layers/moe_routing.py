"""Which experts each token goes to, and with what weight: the router of a sparse MoE block.

    probs = softmax(x @ gate^T)            float32, over all experts
    weights, experts = top_k(probs)        the k most probable experts of each token
    weights /= weights.sum()               when the family renormalises (Mixtral always,
                                           Qwen2-MoE and Qwen3-MoE when norm_topk_prob)

then the weights are rounded to the model dtype, as transformers 4.57's MixtralSparseMoeBlock,
Qwen2MoeSparseMoeBlock and Qwen3MoeSparseMoeBlock do before weighting the experts' outputs.
Every rank computes the whole routing (the gate is replicated): its [tokens, experts] logits cost
nothing next to the experts, and no rank has to tell another where a token goes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Routing:
    """Each token's top-k experts and their weights: [tokens, k] each, row i for token i."""

    experts: torch.Tensor  # int64 expert ids, in descending weight order
    weights: torch.Tensor  # the model dtype

    @property
    def top_k(self) -> int:
        return int(self.experts.shape[1])


def route(logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype) -> Routing:
    """The routing of router `logits` [tokens, experts]: softmax in float32, top-k, optionally
    renormalised over the k chosen, then rounded to `dtype`."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(experts, weights.to(dtype))

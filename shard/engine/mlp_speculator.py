"""IBM's MLP speculator (--speculator-model DIR whose config.json names the architecture
MLPSpeculatorPreTrainedModel, TGI's detection): a chain of small stages on the target's last
hidden state (shard/engine/hidden_drafter.py feeds them).

Stage i takes the state (the hidden state at first, then the previous stage's) and the token
the previous stage chose (at first the row's newest token, which that hidden state chose):

    state = GELU(LN_i(proj_i(state) * state_weight + emb_i(token) * emb_weight * sqrt(inner/2)))
    token = argmax(head_i(state))

with state_weight = 0.5 ** (0.5 / n_predict), emb_weight = sqrt(1 - state_weight ** 2) and LN
an RMS normalisation with a scale and a shift (TGI's MLPSpeculatorLayerNorm). The checkpoint's
tensors are `speculator.{emb,proj,head,ln}.{i}.*`; with `tie_weights` every stage shares stage
0's embedding, head and norm, and stages after the first share proj.1 (TGI's
MLPSpeculatorModelTied).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pytgi_shard.engine.hidden_drafter import LMHead, read_safetensors

# TGI's MLPSpeculatorLayerNorm's epsilon.
LN_EPS = 1e-6


@dataclass(frozen=True, slots=True)
class Stage:
    emb: torch.Tensor
    proj: torch.Tensor
    head: torch.Tensor
    ln_weight: torch.Tensor
    ln_bias: torch.Tensor


class MLPSpeculator:
    """The stages and their two mixing weights."""

    def __init__(self, stages: list[Stage], inner_dim: int) -> None:
        self.stages = stages
        self.state_weight = 0.5 ** (0.5 / len(stages))
        self.emb_scale = math.sqrt(1 - self.state_weight**2) * math.sqrt(inner_dim / 2)

    def __len__(self) -> int:
        return len(self.stages)

    def tokens(self, hidden: torch.Tensor, newest: torch.Tensor, lm_head: LMHead,
               vocab: int) -> torch.Tensor:
        state, token, out = hidden, newest, []
        for s in self.stages:
            z = nn.functional.embedding(token, s.emb) * self.emb_scale
            state = nn.functional.linear(state, s.proj) * self.state_weight + z
            normed = state * torch.rsqrt(state.pow(2).mean(-1, keepdim=True) + LN_EPS)
            state = nn.functional.gelu(normed * s.ln_weight + s.ln_bias)
            token = nn.functional.linear(state, s.head)[..., :vocab].argmax(dim=-1)
            out.append(token)
        return torch.stack(out, dim=1)


def read_mlp_speculator(path: Path, config: dict[str, Any], dtype: torch.dtype,
                        device: torch.device, hidden_size: int) -> MLPSpeculator:
    """The stages of an MLP speculator checkpoint directory; a ValueError naming what does not
    fit."""
    n, inner = config.get("n_predict"), config.get("inner_dim")
    if not isinstance(n, int) or n < 1 or not isinstance(inner, int) or inner < 1:
        raise ValueError(f"n_predict ({n}) and inner_dim ({inner}) must be positive integers")
    tensors = read_safetensors(path)
    tied = bool(config.get("tie_weights", False))

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ValueError(f"no tensor {name} (IBM's MLP speculator layout)")
        return tensors[name].to(device=device, dtype=dtype)

    stages = []
    for i in range(n):
        shared = 0 if tied else i
        proj = take(f"speculator.proj.{min(i, 1) if tied else i}.weight")
        stages.append(Stage(
            emb=take(f"speculator.emb.{shared}.weight"), proj=proj,
            head=take(f"speculator.head.{shared}.weight"),
            ln_weight=take(f"speculator.ln.{shared}.weight"),
            ln_bias=take(f"speculator.ln.{shared}.bias"),
        ))
    if stages[0].proj.shape[1] != hidden_size:
        raise ValueError(f"its first projection takes {stages[0].proj.shape[1]} features, the "
                         f"target's hidden size is {hidden_size}")
    return MLPSpeculator(stages, inner)

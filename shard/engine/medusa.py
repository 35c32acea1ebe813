"""Medusa heads (--speculator-model DIR whose config.json has `medusa_num_heads`, TGI's
detection): one small head per draft on the target's last hidden state
(shard/engine/hidden_drafter.py feeds them).

The checkpoint is TGI's: `{i}.{j}.linear.weight|bias` for head i's residual blocks j <
medusa_num_layers (x + SiLU(linear(x))), then `{i}.{medusa_num_layers}.weight` as the head's
own output projection (the original Medusa layout, TGI's MedusaHeadV1) or, without it, the
target's LM head on the blocks' output (TGI's MedusaHeadV2, medusa_lm_head.safetensors). Head i
on the final hidden state at position p predicts the token at p + 2 + i (the LM head gives
p + 1).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from pytgi_shard.engine.hidden_drafter import LMHead, read_safetensors


class MedusaHeads:
    """The heads' weights: per head its residual blocks' (weight, bias) and its own output
    projection, or None for the target's LM head."""

    def __init__(
        self, blocks: list[list[tuple[torch.Tensor, torch.Tensor]]], outs: list[torch.Tensor | None]
    ) -> None:
        self.blocks = blocks
        self.outs = outs

    def __len__(self) -> int:
        return len(self.blocks)

    def tokens(self, hidden: torch.Tensor, newest: torch.Tensor, lm_head: LMHead,
               vocab: int) -> torch.Tensor:
        """Each head's argmax (over the first `vocab` ids) on [n, hidden] final hidden states:
        [n, heads]. `newest` (the tokens those states chose) is not an input of Medusa's."""
        return self.logits(hidden, lm_head)[..., :vocab].argmax(dim=-1)

    def logits(self, hidden: torch.Tensor, lm_head: LMHead) -> torch.Tensor:
        """[n, hidden] final hidden states -> [n, heads, vocab] logits (float32)."""
        out = []
        for blocks, own in zip(self.blocks, self.outs, strict=True):
            x = hidden
            for weight, bias in blocks:
                x = x + nn.functional.silu(nn.functional.linear(x, weight, bias))
            out.append(nn.functional.linear(x, own).float() if own is not None else lm_head(x))
        return torch.stack(out, dim=1)


def read_heads(path: Path, config: dict[str, Any], dtype: torch.dtype, device: torch.device,
               hidden_size: int) -> MedusaHeads:
    """The heads of a Medusa checkpoint directory; a ValueError naming what does not fit."""
    heads, layers = config.get("medusa_num_heads"), config.get("medusa_num_layers", 1)
    if not isinstance(heads, int) or heads < 1 or not isinstance(layers, int) or layers < 0:
        raise ValueError(f"medusa_num_heads ({heads}) and medusa_num_layers ({layers}) must be "
                         "positive integers")
    tensors = read_safetensors(path)

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ValueError(f"no tensor {name} (TGI's Medusa layout)")
        return tensors[name].to(device=device, dtype=dtype)

    blocks = [[(take(f"{i}.{j}.linear.weight"), take(f"{i}.{j}.linear.bias"))
               for j in range(layers)] for i in range(heads)]
    for i, head in enumerate(blocks):
        for weight, _ in head:
            if tuple(weight.shape) != (hidden_size, hidden_size):
                raise ValueError(f"head {i}'s blocks are {tuple(weight.shape)}, the target's "
                                 f"hidden size is {hidden_size}")
    outs = [take(f"{i}.{layers}.weight") if f"{i}.{layers}.weight" in tensors else None
            for i in range(heads)]
    return MedusaHeads(blocks, outs)

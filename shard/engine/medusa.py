"""Medusa heads (--speculator-model DIR whose config.json has `medusa_num_heads`, TGI's
detection): k small heads on the target's last hidden state propose the next k tokens.

The checkpoint is TGI's: `{i}.{j}.linear.weight|bias` for head i's residual blocks j <
medusa_num_layers (x + SiLU(linear(x))), then `{i}.{medusa_num_layers}.weight` as the head's
own output projection (the original Medusa layout, TGI's MedusaHeadV1) or, without it, the
target's LM head on the blocks' output (TGI's MedusaHeadV2, medusa_lm_head.safetensors). Head i
on the final hidden state at position p predicts the token at p + 2 + i (the LM head gives
p + 1).

Where the hidden state comes from: the target's forward computes it for every position whose
logits a step reads; a hook on the LM head's input keeps the latest eager forward's rows, and the
ModelRunner says before each forward which KV slot each of those rows' tokens went to (`arm`).
A decode step's proposal for a row of length L needs the hidden state at position L - 2 (whose
logits chose its newest token): the previous step computed it (a plain step's one row, a
verification's last kept position, a prefill's last prompt token), and the row's slot of
position L - 2 finds it among the kept rows. A row whose slot is not there (the forward before
was another batch's, a look-ahead's) proposes nothing this step. The slot is unique to a
(sequence, position) while the sequence lives; a stale match can only make a draft wrong, never
an output (verification is exact).

The hook does not run inside a CUDA graph's replay: start-up turns the decode graphs off with
Medusa heads (as with LoRA adapters). Heads are replicated on every rank (each holds the whole
hidden state); the target's LM head they may call is the tensor-parallel one, called by every
rank in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from pytgi_shard.engine.batch import Batch
from pytgi_shard.engine.drafting import Drafts
from pytgi_shard.engine.step_inputs import ForwardInputs

LMHead = Callable[[torch.Tensor], torch.Tensor]


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
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no .safetensors file of Medusa heads")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as reader:
            for name in reader.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[name] = reader.get_tensor(name)

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ValueError(f"{path}: no tensor {name} (TGI's Medusa layout)")
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


class MedusaDrafter:
    """Proposes each asked row's drafts from the heads on its last hidden state, which the hook
    on the target's LM head keeps (the module's docstring)."""

    name = "medusa"

    def __init__(self, heads: MedusaHeads, lm_head: nn.Module, vocab: int) -> None:
        self.heads = heads
        self.lm_head = lm_head
        self.vocab = vocab
        # The latest eager forward's LM head input rows, and each row's token's KV slot.
        self.hidden: torch.Tensor | None = None
        self.slots: torch.Tensor | None = None
        self._armed: torch.Tensor | None = None
        lm_head.register_forward_pre_hook(self._keep)

    def arm(self, inputs: ForwardInputs) -> None:
        """Before a target forward: the slots of the rows its LM head will see."""
        slots = inputs.meta.slot_mapping
        indices = inputs.lm_head_indices
        self._armed = slots if indices is None else slots[indices]

    def disarm(self) -> None:
        self._armed = None

    def _keep(self, module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        if self._armed is not None:
            self.hidden, self.slots = args[0], self._armed
            self._armed = None

    @torch.inference_mode()
    def propose(self, batch: Batch, asks: Sequence[tuple[int, int]]) -> Drafts | None:
        if self.hidden is None or self.slots is None:
            return None
        device = self.hidden.device
        rows = [row for row, _ in asks]
        row_t = torch.tensor(rows, dtype=torch.long, device=device)
        before = torch.tensor([batch.requests[row].length - 2 for row in rows], device=device)
        wanted = batch.slot_table[row_t, before.clamp(min=0)]
        match = wanted.unsqueeze(1) == self.slots.unsqueeze(0)
        found = match.any(dim=1) & (before >= 0)
        hidden = self.hidden[match.int().argmax(dim=1)]
        tokens = self.heads.logits(hidden, self.lm_head)[..., : self.vocab].argmax(dim=-1)
        packed = torch.cat([found.long().unsqueeze(1), tokens], dim=1).tolist()
        out_rows: list[int] = []
        out_tokens: list[list[int]] = []
        for (row, k), (hit, *proposal) in zip(asks, packed, strict=True):
            if hit:
                out_rows.append(row)
                out_tokens.append(proposal[:k])
        return Drafts(out_rows, out_tokens) if out_rows else None

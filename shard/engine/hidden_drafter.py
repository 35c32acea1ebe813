"""Drafters on the target's last hidden state (--speculator-model with speculator heads: Medusa,
shard/engine/medusa.py; IBM's MLP speculator, shard/engine/mlp_speculator.py).

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

The hook does not run inside a CUDA graph's replay: the decode graphs keep, per bucket, the
hidden-state tensor the hook saw while capturing (graph memory that each replay rewrites) and
hand it, with the buffers' slots, to this drafter after each replay (decode_graphs.HiddenTap).
Heads are replicated on every rank (each holds the whole hidden state); the target's LM head
they may call is the tensor-parallel one, called by every rank in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from torch import nn

from pytgi_shard.engine.batch import Batch
from pytgi_shard.engine.drafting import Drafts
from pytgi_shard.engine.step_inputs import ForwardInputs

LMHead = Callable[[torch.Tensor], torch.Tensor]


class SpeculatorHeads(Protocol):
    """Speculator heads: their drafts per row from its final hidden state."""

    def __len__(self) -> int:
        """The most drafts a row gets."""
        ...

    def tokens(self, hidden: torch.Tensor, newest: torch.Tensor, lm_head: LMHead,
               vocab: int) -> torch.Tensor:
        """[n, hidden] final hidden states at each row's position L - 2 and [n] the tokens they
        chose (each row's newest) -> [n, len(self)] drafts, ids below `vocab`."""
        ...


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a directory's .safetensors files; a ValueError when there is none."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError("the directory has no .safetensors file")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as reader:
            for name in reader.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[name] = reader.get_tensor(name)
    return tensors


class HiddenStateDrafter:
    """Proposes each asked row's drafts from speculator heads on its last hidden state, which the
    hook on the target's LM head keeps (the module's docstring)."""

    def __init__(self, name: str, heads: SpeculatorHeads, lm_head: nn.Module, vocab: int) -> None:
        self.name = name
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
        tokens = self.heads.tokens(hidden, batch.last_ids[row_t], self.lm_head, self.vocab)
        packed = torch.cat([found.long().unsqueeze(1), tokens], dim=1).tolist()
        out_rows: list[int] = []
        out_tokens: list[list[int]] = []
        for (row, k), (hit, *proposal) in zip(asks, packed, strict=True):
            if hit:
                out_rows.append(row)
                out_tokens.append(proposal[:k])
        return Drafts(out_rows, out_tokens) if out_rows else None

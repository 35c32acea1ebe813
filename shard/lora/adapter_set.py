"""The adapters a shard serves: parsed from --lora-adapters, read, attached to the model; their
names are what Info reports (index i + 1 on the wire is names[i])."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from pytgi_shard.device.distributed import Dist
from pytgi_shard.lora.attach import attach_adapters
from pytgi_shard.lora.layer import RowAdapters
from pytgi_shard.lora.peft_adapter import read_adapter, resolve_adapter_dir
from pytgi_shard.lora.spec import parse_lora_adapters

log = logging.getLogger(__name__)


@dataclass(slots=True)
class AdapterSet:
    names: tuple[str, ...] = ()
    # Bound per forward by the ModelRunner; every LoraLinear reads it.
    rows: RowAdapters = field(default_factory=RowAdapters)

    def __bool__(self) -> bool:
        return bool(self.names)


def load_adapter_set(text: str | None, model: object, dtype: torch.dtype,
                     dist: Dist) -> AdapterSet:
    """Every adapter of `text` read and attached to `model`, or AdapterRefused / ValueError in
    one line naming the adapter and the reason (the shard then refuses to start)."""
    specs = parse_lora_adapters(text)
    if not specs:
        return AdapterSet()
    adapters = []
    for spec in specs:
        directory = resolve_adapter_dir(spec, None, None)
        adapter = read_adapter(spec.name, directory, dtype)
        log.info("LoRA adapter %s from %s: rank %d, scale %g, %d projections", spec.name,
                 directory, adapter.rank, adapter.scale, len(adapter.pairs))
        adapters.append(adapter)
    rows = attach_adapters(model, adapters, dist)
    return AdapterSet(tuple(s.name for s in specs), rows)

"""Reading one PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) into per-layer
(A, B·scale) pairs keyed by the projection they adapt, every refusal one line naming the adapter.

PEFT's tensor names: `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` (A: rank ×
in) and `...lora_B.weight` (B: out × rank). The scale is lora_alpha / r, or lora_alpha / sqrt(r)
with use_rslora (rsLoRA)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from pytgi_shard.lora.spec import AdapterSpec

MAX_RANK = 64
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
# Modules of checkpoints that fuse q/k/v and gate/up themselves (Phi-3).
FUSED_MODULES = ("qkv_proj", "gate_up_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES + FUSED_MODULES
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class AdapterRefused(ValueError):
    """An adapter pytgi cannot serve with this model: the message is one line naming it."""


@dataclass(slots=True)
class PeftAdapter:
    name: str
    rank: int
    scale: float
    # (layer, module) -> (A: rank × in, B: out × rank, the scale folded in).
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def resolve_adapter_dir(spec: AdapterSpec, hub_cache: str | None, revision: str | None) -> Path:
    """A local directory, else the Hub repository's two adapter files (through the cache, as
    --model-id is resolved)."""
    local = Path(spec.source).expanduser()
    if local.is_dir():
        return local
    if spec.source.startswith(("/", "./", "../", "~")):
        raise AdapterRefused(f"LoRA adapter {spec.name!r}: directory {spec.source} does not exist")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(spec.source, revision=revision, cache_dir=hub_cache,
                                      allow_patterns=[CONFIG_FILE, WEIGHTS_FILE]))
    except Exception as e:  # noqa: BLE001 - any Hub failure is one line for the operator
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise AdapterRefused(f"LoRA adapter {spec.name!r}: cannot fetch {spec.source}: "
                             f"{first}") from e


def read_adapter(name: str, directory: Path, dtype: torch.dtype) -> PeftAdapter:
    """The adapter's pairs, B scaled, in `dtype`; refuses what is not a plain LoRA on the
    supported projections with rank <= MAX_RANK."""
    config = _read_config(name, directory)
    rank = int(config.get("r", 0))
    if not 0 < rank <= MAX_RANK:
        raise AdapterRefused(f"LoRA adapter {name!r}: rank r={rank} is not in 1..{MAX_RANK}")
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    for key, what in (("use_dora", "DoRA"), ("rank_pattern", "per-module ranks (rank_pattern)"),
                      ("alpha_pattern", "per-module alphas (alpha_pattern)"),
                      ("modules_to_save", "modules_to_save")):
        if config.get(key):
            raise AdapterRefused(f"LoRA adapter {name!r}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise AdapterRefused(f"LoRA adapter {name!r}: bias={config['bias']!r} is not supported "
                             "(only bias='none')")
    weights_path = directory / WEIGHTS_FILE
    if not weights_path.is_file():
        raise AdapterRefused(f"LoRA adapter {name!r}: {directory} has no {WEIGHTS_FILE}")
    tensors = load_file(str(weights_path))
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise AdapterRefused(f"LoRA adapter {name!r}: tensor {key} adapts no supported "
                                 f"projection ({', '.join(SUPPORTED_MODULES)})")
        layer, module, half = int(m.group(1)), m.group(2), m.group(3)
        if module not in SUPPORTED_MODULES:
            raise AdapterRefused(f"LoRA adapter {name!r}: module {module!r} is not supported "
                                 f"(supported: {', '.join(SUPPORTED_MODULES)})")
        halves.setdefault((layer, module), {})[half] = tensor
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise AdapterRefused(f"LoRA adapter {name!r}: layer {layer} {module} lacks lora_A "
                                 "or lora_B")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise AdapterRefused(f"LoRA adapter {name!r}: layer {layer} {module} has A "
                                 f"{tuple(a.shape)} and B {tuple(b.shape)}, not rank {rank}")
        pairs[(layer, module)] = (a.to(dtype), (b.float() * scale).to(dtype))
    if not pairs:
        raise AdapterRefused(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA tensors")
    return PeftAdapter(name, rank, scale, pairs)


def _read_config(name: str, directory: Path) -> dict[str, Any]:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise AdapterRefused(f"LoRA adapter {name!r}: {directory} has no {CONFIG_FILE} (not a "
                             "PEFT adapter)")
    config = json.loads(path.read_text())
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterRefused(f"LoRA adapter {name!r}: peft_type {peft_type} is not LoRA")
    return dict(config)

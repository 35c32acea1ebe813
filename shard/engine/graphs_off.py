"""When a shard decodes without graphs: CUDA graphs on a GPU, compiled steps on a CPU
(shard/engine/decode_graphs.py, shard/engine/cpu_graphs.py). One function answers for the
target and the draft model, with the reason Warmup logs."""

from __future__ import annotations

from torch import nn

from pytgi_shard.device.capabilities import DeviceCapabilities
from pytgi_shard.lora.layer import lora_rows_of
from pytgi_shard.models.model import Model
from pytgi_shard.quantization.linear_weight import QuantizedWeight
from pytgi_shard.settings import ShardSettings

# Attention backends whose decode launches are capturable: no host synchronisation, and a grid
# that depends on the batch size only (never on a step's context lengths).
CAPTURABLE_BACKENDS = ("triton",)


def graphs_off_reason(
    settings: ShardSettings, model: Model, caps: DeviceCapabilities, world_size: int = 1
) -> str | None:
    """Why this shard must decode without CUDA graphs (on a CPU: compiled steps), or None when
    it can capture them: the device (`caps`, resolved at start-up) must allow graphs, then the
    settings and the model."""
    if caps.kind == "cpu":
        return _cpu_graphs_off_reason(settings, model, world_size)
    if not settings.cuda_graphs:
        return "--cuda-graphs 0"
    if not caps.cuda_graphs:
        return f"the model runs on {caps.kind}"
    if settings.attention not in CAPTURABLE_BACKENDS:
        return (
            f"the {settings.attention} attention backend's shapes follow the context length "
            f"(capturable: {', '.join(CAPTURABLE_BACKENDS)})"
        )
    if not model.graph_capturable:
        return (f"{model.model_type}'s forward is not capturable (the transformers fallback, "
                "an encoder-decoder)")
    return _uncapturable_weights(model)


def _cpu_graphs_off_reason(settings: ShardSettings, model: Model, world_size: int) -> str | None:
    """Why a CPU shard must decode eagerly: compiled steps (shard/engine/cpu_graphs.py) are
    opt-in, run on one rank (the gloo collectives are not traced), and trace the model's own
    layers only (a LoRA layer's fused CPU kernel is outside what the compiler sees)."""
    if not settings.cpu_graphs:
        return "--cpu-graphs not set"
    if world_size > 1:
        return f"compiled decode steps run on one rank, this shard is one of {world_size}"
    if settings.attention not in (None, "reference"):
        return f"the {settings.attention} attention runs in its interpreter on a CPU"
    if not model.graph_capturable:
        return (f"{model.model_type}'s forward is not capturable (the transformers fallback, "
                "an encoder-decoder)")
    if lora_rows_of(model) is not None:
        return "LoRA adapters' layers run their own CPU kernel"
    return _uncapturable_weights(model)


def _uncapturable_weights(model: Model) -> str | None:
    """The reason quantized weights that synchronise with the host in their matmul give."""
    uncapturable = sorted({
        type(m).__name__ for m in (model.modules() if isinstance(model, nn.Module) else ())
        if isinstance(m, QuantizedWeight) and not m.graph_capturable
    })
    if uncapturable:
        return f"{', '.join(uncapturable)} synchronises with the host in its matmul"
    return None

"""Start-up of one rank: device, process group, dtype, model and tokenizer, peer addresses."""

from __future__ import annotations

import dataclasses
import logging
import socket

import torch
import torch.distributed as tdist

from pytgi_shard.device.capabilities import DeviceCapabilities, probe_capabilities
from pytgi_shard.device.distributed import Dist, init_distributed
from pytgi_shard.engine.engine import Engine
from pytgi_shard.engine.kv_format import fp8_refusal
from pytgi_shard.lora.adapter_set import AdapterSet, load_adapter_set
from pytgi_shard.models import MODELS, get_model
from pytgi_shard.models.encoder_decoder_model import EncoderDecoderModel
from pytgi_shard.models.model import Model
from pytgi_shard.models.model_config import ModelConfig
from pytgi_shard.output.detokenizer import Detokenizer
from pytgi_shard.quantization.resolution import resolve_quantization
from pytgi_shard.service.speculator import SpeculatorRefused, load_draft_model
from pytgi_shard.settings import ShardSettings

log = logging.getLogger(__name__)

# The torch dtype of each of pytgi_proto.contracts.DTYPES.
TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def choose_device(rank: int) -> torch.device:
    """GPU `rank % device_count` when there is one (as TGI), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def resolve_dtype(
    settings: ShardSettings, config: ModelConfig, device: torch.device
) -> torch.dtype:
    """--dtype, else the checkpoint's half precision on GPU (bfloat16 for a float32 one), else
    float32 on CPU, where half precision is slow."""
    if settings.dtype is not None:
        return TORCH_DTYPES[settings.dtype]
    if device.type != "cuda":
        return torch.float32
    name = config.raw.get("torch_dtype") or config.raw.get("dtype")
    if name in ("float16", "bfloat16"):
        return TORCH_DTYPES[name]
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


class StartupRefused(ValueError):
    """Settings this model cannot be served with: one line for the operator, no traceback."""


def read_config(settings: ShardSettings) -> ModelConfig:
    """config.json, read once, with --rope-scaling/--rope-factor in place of its rope_scaling.

    The override reaches pytgi's own implementations, whose readers all take rope_scaling from
    this object; the transformers fallback reads the file itself, so it is refused there rather
    than silently ignored. Families without RoPE ignore it, as in TGI.
    """
    config = ModelConfig.read(settings.model_path)
    override = settings.rope_scaling_override
    if override is None:
        return config
    if config.model_type not in MODELS:
        raise StartupRefused(
            f"--rope-scaling/--rope-factor apply to pytgi's own model implementations; "
            f"{config.model_type} runs through transformers, which reads config.json itself: "
            "set rope_scaling there instead"
        )
    log.info("rope scaling %s in place of config.json's %s", override,
             config.raw.get("rope_scaling"))
    return config.with_rope_scaling(override)


def resolve_attention(settings: ShardSettings, caps: DeviceCapabilities) -> str:
    """--attention, else the device's default (the reference under --disable-custom-kernels)."""
    if settings.attention is not None:
        return settings.attention
    return caps.default_attention


def load_engine(settings: ShardSettings) -> Engine:
    # The one reading of config.json: everything below is handed this object.
    config = read_config(settings)
    # Before the process group: a refused quantization fails every rank at once, alike.
    quantization = resolve_quantization(settings.model_path, config.raw, settings.quantize)
    settings = dataclasses.replace(settings, quantize=quantization.method if quantization else "")
    device = choose_device(settings.rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.set_per_process_memory_fraction(settings.cuda_memory_fraction, device)
    # Resolved once: every layer built below reads its kernel choices from dist.caps.
    caps = probe_capabilities(device, custom_kernels=not settings.disable_custom_kernels)
    dist = init_distributed(
        settings.rank, settings.world_size, settings.master_addr, settings.master_port, device,
        caps,
    )
    dtype = resolve_dtype(settings, config, device)
    settings = dataclasses.replace(settings, attention=resolve_attention(settings, caps))
    kernels = "plain PyTorch only" if settings.disable_custom_kernels else "custom kernels allowed"
    log.info("loading %s on %s as %s, %s attention, %s", settings.model_path, device, dtype,
             settings.attention, kernels)
    model = get_model(
        config,
        dtype=dtype,
        dist=dist,
        trust_remote_code=settings.trust_remote_code,
        attention=settings.attention or "reference",
        quantization=quantization,
    )
    refusal = fp8_refusal(settings, model)
    if refusal is not None:
        raise StartupRefused(refusal)
    if settings.speculate and not settings.speculator_model and isinstance(
        model, EncoderDecoderModel
    ):
        # The engine sets it aside (its decoder's steps are not the varlen verification step);
        # /info reports speculate 0, so the router holds no draft slots either.
        log.warning("--speculate %d: %s is an encoder-decoder, which does not speculate",
                    settings.speculate, model.model_type)
    adapters = load_lora(settings, model, dtype, dist)
    detokenizer = Detokenizer.from_model_dir(settings.model_path, config.raw)
    try:
        draft = load_draft_model(settings, model, detokenizer, dtype, dist)
    except SpeculatorRefused as e:
        raise StartupRefused(str(e)) from e
    return Engine(model, detokenizer, dist, settings, adapters, draft)


def load_lora(settings: ShardSettings, model: Model, dtype: torch.dtype, dist: Dist
              ) -> AdapterSet:
    """--lora-adapters read and attached, or StartupRefused in one line naming the adapter (on
    every rank alike: each reads the same files and checks the same shapes)."""
    try:
        return load_adapter_set(settings, model, dtype, dist)
    except ValueError as e:
        raise StartupRefused(str(e)) from e


def peer_urls(settings: ShardSettings, dist: Dist) -> list[str]:
    """Every rank's gRPC address, index = rank (ServiceDiscovery).

    Unix sockets follow from the base path. Over TCP (a pod per shard) each rank advertises its
    own address and all ranks exchange them once, here, through the process group.
    """
    if settings.port is None:
        return [settings.uds_url(r) for r in range(settings.world_size)]
    mine = settings.advertise_address or f"{socket.gethostname()}:{settings.port}"
    if dist.world_size == 1:
        return [mine]
    gathered: list[object] = [None] * dist.world_size
    tdist.all_gather_object(gathered, mine, group=dist.group)
    return [str(url) for url in gathered]

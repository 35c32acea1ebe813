"""Everything a shard process is configured with, in one typed object built by the CLI."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytgi_proto.contracts import DEFAULT_UDS_PATH, DTYPES, shard_socket
from pytgi_shard.quantization.method import VALUES as QUANTIZE_VALUES

# Decode batch sizes captured as CUDA graphs: TGI's --cuda-graphs default (1..32) extended to the
# batch sizes a server GPU decodes at; Warmup caps them at the router's max_batch_size.
DEFAULT_CUDA_GRAPHS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def parse_cuda_graphs(text: str, source: str = "--cuda-graphs") -> tuple[int, ...]:
    """TGI's --cuda-graphs format: a comma list of batch sizes ("1,2,4,8"), or "0" for none.

    Sorted and deduplicated. A 0 among other sizes is refused rather than dropped (TGI drops it):
    it is more likely a typo than a wish.
    """
    usage = f"{source} takes a comma list of batch sizes such as 1,2,4,8, or 0 to disable"
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"{usage}; got {text!r}") from None
    if sizes == [0]:
        return ()
    if min(sizes) < 1:
        raise ValueError(f"{usage} (0 alone); got {text!r}")
    return tuple(sorted(set(sizes)))


# What the cache of constrained requests' grammars and prepared matchers may hold
# (shard/structured_output/cache.py): --grammar-cache-bytes.
DEFAULT_GRAMMAR_CACHE_BYTES = 512 * 1024 * 1024

# TGI's --kv-cache-dtype values: the FP8 formats the KV cache may be stored in (unset: the
# model's dtype). shard/attention/kv_quant.py maps them to torch dtypes.
KV_CACHE_DTYPES = ("fp8_e4m3fn", "fp8_e5m2")

# TGI's --rope-scaling values: the two kinds that take nothing but a factor.
ROPE_SCALINGS = ("linear", "dynamic")
# The most drafts --speculate may ask per sequence and step: a verification forward carries
# N + 1 tokens per row, and past a few drafts an n-gram's later tokens are rarely all right.
SPECULATE_MAX = 16


def rope_override(scaling: str | None, factor: float | None) -> dict[str, Any] | None:
    """The `rope_scaling` object --rope-scaling/--rope-factor put in place of config.json's, as
    TGI reads the pair: the kind alone scales by 1.0, the factor alone is linear; neither keeps
    the model's own (None)."""
    if scaling is None and factor is None:
        return None
    kind = scaling or "linear"
    # Both spellings: transformers 4 checkpoints wrote `type`, later ones `rope_type`.
    return {"rope_type": kind, "type": kind, "factor": 1.0 if factor is None else factor}


def rope_problems(scaling: str | None, factor: float | None) -> list[str]:
    """Why a --rope-scaling/--rope-factor pair cannot be served (the launcher checks the same)."""
    out = []
    if scaling is not None and scaling not in ROPE_SCALINGS:
        out.append(f"--rope-scaling must be one of {', '.join(ROPE_SCALINGS)}, got {scaling}")
    if factor is not None and not (math.isfinite(factor) and factor > 0):
        out.append(f"--rope-factor must be a positive number, got {factor}")
    return out


def kernel_problems(disable_custom_kernels: bool, attention: str | None) -> list[str]:
    """--disable-custom-kernels asks for the reference attention: an explicit Triton one
    contradicts it (refused rather than one of the two silently winning)."""
    if disable_custom_kernels and attention == "triton":
        return ["--attention triton contradicts --disable-custom-kernels (plain PyTorch only)"]
    return []


@dataclass(frozen=True, slots=True)
class ShardSettings:
    model_path: Path
    rank: int = 0
    world_size: int = 1
    master_addr: str = "localhost"
    master_port: int = 29500
    # Exactly one transport: a unix socket `{uds_path}-{rank}` (default) or a TCP port.
    uds_path: str | None = DEFAULT_UDS_PATH
    port: int | None = None
    # Host:port this rank tells the others (TCP only); None means `<hostname>:<port>`.
    advertise_address: str | None = None
    # None: the checkpoint's dtype on GPU (half precision), float32 on CPU.
    dtype: str | None = None
    # TGI's --quantize value (quantization/method.py); None: the checkpoint's own, if any. After
    # start-up resolves it, the method that runs ("" for float weights), which Info reports.
    quantize: str | None = None
    # TGI's --kv-cache-dtype: an FP8 format of KV_CACHE_DTYPES; None: the model's dtype.
    kv_cache_dtype: str | None = None
    # TGI's --speculate: up to N n-gram drafts per sequence and decode step, verified in one
    # forward (shard/engine/speculation.py); 0: off, every step as without it.
    speculate: int = 0
    # A draft model's directory (--speculator-model): it proposes the --speculate drafts in
    # place of the n-gram index (shard/engine/draft_model.py); None: n-gram drafts.
    speculator_model: Path | None = None
    # TGI's --lora-adapters: `id`, `name=id` or `name=path`, comma-separated (shard/lora/spec.py);
    # loaded at start-up, selected per request by the wire Request's adapter_index.
    lora_adapters: str | None = None
    # LoadAdapter/UnloadAdapter served (--enable-lora-runtime-updates): every supported projection
    # is wrapped at start-up, with room for --max-loras adapters of rank --max-lora-rank.
    lora_runtime_updates: bool = False
    # Adapters resident on the device at once (device slots); None: the start-up adapters' count,
    # at least DEFAULT_MAX_LORAS (shard/lora/adapter_set.py). Past it the least recently used
    # adapter with no rows is evicted to host memory and copied back when asked for.
    max_loras: int | None = None
    # vLLM's --max-cpu-loras: loaded adapters whose fused weights stay in host memory (those on
    # the device included); past it the least recently used one off the device with no rows is
    # dropped and re-read from its directory when next needed. None: every loaded adapter stays.
    max_cpu_loras: int | None = None
    # The largest adapter rank accepted (slots are sized for it); None: the start-up adapters'
    # largest with no runtime updates, else MAX_RANK.
    max_lora_rank: int | None = None
    trust_remote_code: bool = False
    # None: the device's default (DeviceCapabilities.default_attention), resolved at start-up.
    attention: str | None = None
    # Plain PyTorch only (TGI's --disable-custom-kernels): the reference attention, and no fused
    # Triton norm, rotary, activation, MoE or dequantize-GEMM kernel (Dist.caps).
    disable_custom_kernels: bool = False
    # TGI's --rope-scaling / --rope-factor: replace config.json's rope_scaling (rope_override).
    rope_scaling: str | None = None
    rope_factor: float | None = None
    block_size: int = 16
    # CPU KV budget in tokens when the router's Warmup does not impose one.
    max_total_tokens: int | None = None
    cuda_memory_fraction: float = 1.0
    # Queue each step's next decode forward before reading its tokens back (shard/engine/lookahead.py);
    # None: on for CUDA devices.
    overlap: bool | None = None
    # Advance constrained requests' grammars in a grammar thread alongside the forward
    # (shard/structured_output/worker.py); None: on for accelerators, inline on the CPU.
    grammar_thread: bool | None = None
    grammar_cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES
    # Decode batch sizes to capture as CUDA graphs; () disables them.
    cuda_graphs: tuple[int, ...] = DEFAULT_CUDA_GRAPHS
    # On a CPU, decode batch sizes whose forward is compiled (shard/engine/cpu_graphs.py); ():
    # eager decode. Opt-in: each size compiles for tens of seconds at the first start.
    cpu_graphs: tuple[int, ...] = ()
    watermark_gamma: float = 0.5
    watermark_delta: float = 2.0
    json_output: bool = False
    log_level: str = "INFO"
    otlp_endpoint: str | None = None
    otlp_service_name: str = "pytgi.shard"
    # A shared secret every call but grpc.health.v1 must carry (shard/service/token_auth.py); None: open.
    shard_token: str | None = field(default=None, repr=False)
    # gRPC reflection; None: on for a unix socket, off over TCP (it maps the API for anyone).
    grpc_reflection: bool | None = None
    # Set by the launcher: a health service `pytgi.instance.<id>` tells it this process is its own.
    instance_id: str | None = None
    # Rank 0 appends each step's phases to this JSON-lines file (shard/engine/step_timeline.py,
    # shard/service/timeline_file.py); None: no timeline.
    step_timeline: Path | None = None

    def __post_init__(self) -> None:
        problems = list(self._problems())
        if problems:
            raise ValueError("; ".join(problems))

    def _problems(self) -> list[str]:
        out = []
        if self.world_size < 1:
            out.append(f"--world-size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < max(self.world_size, 1):
            out.append(f"--rank must be in [0, {self.world_size}), got {self.rank}")
        if (self.uds_path is None) == (self.port is None):
            out.append("give exactly one of --uds-path and --port")
        if self.port is not None and not 0 < self.port < 65536:
            out.append(f"--port must be in 1..65535, got {self.port}")
        if not 0 < self.master_port < 65536:
            out.append(f"--master-port must be in 1..65535, got {self.master_port}")
        if self.grammar_cache_bytes <= 0:
            out.append(f"--grammar-cache-bytes must be > 0, got {self.grammar_cache_bytes}")
        if self.dtype is not None and self.dtype not in DTYPES:
            out.append(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype}")
        if self.quantize and self.quantize not in QUANTIZE_VALUES:
            out.append(f"--quantize must be one of {', '.join(QUANTIZE_VALUES)}, got "
                       f"{self.quantize}")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            out.append(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                       f"{self.kv_cache_dtype}")
        if not 0 <= self.speculate <= SPECULATE_MAX:
            out.append(f"--speculate must be in 0..{SPECULATE_MAX}, got {self.speculate}")
        if self.speculator_model is not None and not self.speculate:
            out.append("--speculator-model drafts --speculate N tokens per sequence and step: "
                       f"give --speculate N (1..{SPECULATE_MAX})")
        if self.block_size < 1:
            out.append(f"--block-size must be >= 1, got {self.block_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            out.append(f"--max-total-tokens must be >= 1, got {self.max_total_tokens}")
        if not 0.0 < self.cuda_memory_fraction <= 1.0:
            out.append(f"--cuda-memory-fraction must be in (0, 1], got {self.cuda_memory_fraction}")
        if any(size < 1 for size in self.cuda_graphs):
            out.append(f"--cuda-graphs sizes must be >= 1, got {self.cuda_graphs}")
        if any(size < 1 for size in self.cpu_graphs):
            out.append(f"--cpu-graphs sizes must be >= 1, got {self.cpu_graphs}")
        if self.shard_token is not None and not self.shard_token:
            out.append("--shard-token must not be empty")
        if not 0.0 < self.watermark_gamma < 1.0:
            out.append(f"--watermark-gamma must be in (0, 1), got {self.watermark_gamma}")
        out += rope_problems(self.rope_scaling, self.rope_factor)
        out += kernel_problems(self.disable_custom_kernels, self.attention)
        return out

    @property
    def rope_scaling_override(self) -> dict[str, Any] | None:
        return rope_override(self.rope_scaling, self.rope_factor)

    @property
    def reflection_enabled(self) -> bool:
        return self.grpc_reflection if self.grpc_reflection is not None else self.port is None

    @property
    def socket_path(self) -> str | None:
        """This rank's unix socket file, None over TCP."""
        return None if self.uds_path is None else shard_socket(self.uds_path, self.rank)

    @property
    def listen_address(self) -> str:
        """What this rank's gRPC server binds."""
        if self.port is not None:
            return f"[::]:{self.port}"
        return self.uds_url(self.rank)

    def uds_url(self, rank: int) -> str:
        assert self.uds_path is not None
        return f"unix://{shard_socket(self.uds_path, rank)}"

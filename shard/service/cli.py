"""`pytgi-shard`: the shard's command line.

Subcommands register themselves through SUBCOMMANDS (one function each that adds its parser and
sets `run`); `serve` lives here, others live with the code they drive.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from pytgi_proto.cli_env import parse_bool
from pytgi_proto.contracts import DEFAULT_UDS_PATH, DTYPES
from pytgi_proto.version import add_version_flag
from pytgi_shard.quantization.errors import QuantizationError
from pytgi_shard.quantization.method import parse_quantize
from pytgi_shard.service.ctl import add_ctl_command
from pytgi_shard.service.logs import configure_logging
from pytgi_shard.settings import (
    KV_CACHE_DTYPES,
    ROPE_SCALINGS,
    ShardSettings,
    parse_cuda_graphs,
)
from pytgi_shard.weights.download import add_download_command

log = logging.getLogger("pytgi_shard")

# Environment variables the launcher (and TGI's) sets for each shard; flags win over them.
ENV_FALLBACKS = {
    "rank": ("RANK", int),
    "world_size": ("WORLD_SIZE", int),
    "master_addr": ("MASTER_ADDR", str),
    "master_port": ("MASTER_PORT", int),
    "cuda_memory_fraction": ("CUDA_MEMORY_FRACTION", float),
    "watermark_gamma": ("WATERMARK_GAMMA", float),
    "watermark_delta": ("WATERMARK_DELTA", float),
    "shard_token": ("SHARD_TOKEN", str),
    "rope_scaling": ("ROPE_SCALING", str),
    "rope_factor": ("ROPE_FACTOR", float),
    "grammar_cache_bytes": ("GRAMMAR_CACHE_BYTES", int),
    "kv_cache_dtype": ("KV_CACHE_DTYPE", str),
    "speculate": ("SPECULATE", int),
    "speculator_model": ("SPECULATOR_MODEL", Path),
    "lora_adapters": ("LORA_ADAPTERS", str),
    "max_loras": ("MAX_LORAS", int),
    "max_cpu_loras": ("MAX_CPU_LORAS", int),
    "max_lora_rank": ("MAX_LORA_RANK", int),
}


def add_serve_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="load a model and serve it over gRPC")
    p.add_argument("model_path", type=Path, help="local model directory (HF layout)")
    p.add_argument("--rank", type=int, help="this shard's rank (env RANK; default 0)")
    p.add_argument("--world-size", type=int, help="number of shards (env WORLD_SIZE; default 1)")
    p.add_argument("--master-addr", help="rendezvous host (env MASTER_ADDR; default localhost)")
    p.add_argument(
        "--master-port", type=int, help="rendezvous port (env MASTER_PORT; default 29500)"
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--uds-path", help=f"socket base name; listens on PATH-RANK (default {DEFAULT_UDS_PATH})"
    )
    where.add_argument("--port", type=int, help="listen on this TCP port instead of a unix socket")
    p.add_argument(
        "--advertise-address",
        help="HOST:PORT peers reach this rank at (TCP; default <hostname>:<port>)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        help="default: the checkpoint's half precision on GPU, float32 on CPU",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        help="store the KV cache in FP8, with the checkpoint's per-layer k/v scales (1.0 "
        "without them); env KV_CACHE_DTYPE; default: the model's dtype",
    )
    p.add_argument(
        "--speculate",
        type=int,
        help="up to N n-gram drafts per greedy sequence and decode step, verified in one "
        "forward (env SPECULATE; default 0: off)",
    )
    p.add_argument(
        "--speculator-model",
        type=Path,
        help="drafts for --speculate: a draft model's directory (a model of the registry with "
        "the same tokenizer; its own share of the KV memory) or speculator heads (Medusa, IBM's "
        "MLP speculator) (env SPECULATOR_MODEL; default: n-gram drafts)",
    )
    p.add_argument(
        "--lora-adapters",
        help="LoRA adapters to serve: a comma list of `id`, `name=id` or `name=path` (PEFT "
        "directories or Hub ids), for pytgi's Llama-family models (env LORA_ADAPTERS)",
    )
    p.add_argument(
        "--enable-lora-runtime-updates", action="store_true",
        help="serve LoadAdapter/UnloadAdapter (the router's /v1/load_lora_adapter and "
        "/v1/unload_lora_adapter); env ENABLE_LORA_RUNTIME_UPDATES",
    )
    p.add_argument(
        "--max-loras", type=int,
        help="LoRA adapters resident on the device at once; past it the least recently used "
        "idle one is evicted to host memory (env MAX_LORAS; default: the start-up adapters, at "
        "least 4)",
    )
    p.add_argument(
        "--max-cpu-loras", type=int,
        help="LoRA adapters kept in host memory (those on the device included; >= --max-loras); "
        "past it the least recently used idle one off the device is dropped and re-read from "
        "its path when next used (env MAX_CPU_LORAS; default: every loaded adapter is kept)",
    )
    p.add_argument(
        "--max-lora-rank", type=int,
        help="the largest LoRA rank accepted, 1..64: device slots are sized for it (env "
        "MAX_LORA_RANK; default 64 with runtime updates, else the start-up adapters' largest)",
    )
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument(
        "--quantize",
        type=parse_quantize,
        help="quantize a float checkpoint on load (bitsandbytes, bitsandbytes-nf4, "
        "bitsandbytes-fp4, eetq, fp8) or confirm a pre-quantized one's method (gptq, awq, fp8, "
        "compressed-tensors; marlin: gptq); env QUANTIZE; default: the checkpoint's own",
    )
    p.add_argument(
        "--attention",
        help="attention backend: triton or reference (default: triton on CUDA when Triton is "
        "installed, else reference)",
    )
    p.add_argument(
        "--disable-custom-kernels",
        action="store_true",
        help="plain PyTorch only: reference attention, no Triton norm, rotary, activation, MoE "
        "or dequantize kernels (env DISABLE_CUSTOM_KERNELS)",
    )
    p.add_argument(
        "--rope-scaling",
        choices=ROPE_SCALINGS,
        help="replace config.json's rope_scaling (env ROPE_SCALING; factor 1.0 unless "
        "--rope-factor)",
    )
    p.add_argument(
        "--rope-factor", type=float, help="RoPE scaling factor (env ROPE_FACTOR; alone: linear)"
    )
    p.add_argument("--block-size", type=int, default=16, help="KV-cache block size in tokens")
    p.add_argument(
        "--max-total-tokens", type=int, help="CPU KV budget in tokens when Warmup sets none"
    )
    p.add_argument(
        "--cuda-memory-fraction",
        type=float,
        help="share of GPU memory to use (env CUDA_MEMORY_FRACTION; default 1.0)",
    )
    p.add_argument(
        "--cuda-graphs",
        help="decode batch sizes to capture as CUDA graphs, a comma list like 1,2,4,8; 0 disables "
        "(env CUDA_GRAPHS; default 1,2,4,...,256 capped at the router's max batch size)",
    )
    p.add_argument(
        "--cpu-graphs",
        help="on a CPU, decode batch sizes whose forward is compiled (torch.compile, inductor's "
        "C++ backend), a comma list like 1,4,16,64; 0 or unset: eager",
    )
    p.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="queue each decode step's next forward before reading its tokens back (default: "
        "on for CUDA devices)",
    )
    p.add_argument(
        "--grammar-thread",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="advance constrained requests' grammars in a thread alongside the forward "
        "(default: on for accelerators; on the CPU inline, where the forward holds every core)",
    )
    p.add_argument(
        "--grammar-cache-bytes",
        type=int,
        help="memory for constrained requests' grammars and the matchers prepared for them "
        "(estimated; env GRAMMAR_CACHE_BYTES; default 536870912, 512 MiB)",
    )
    p.add_argument("--watermark-gamma", type=float, help="env WATERMARK_GAMMA; default 0.5")
    p.add_argument("--watermark-delta", type=float, help="env WATERMARK_DELTA; default 2.0")
    p.add_argument(
        "--shard-token",
        help="shared secret every call but health checks must carry as `authorization: Bearer "
        "TOKEN` metadata (env SHARD_TOKEN, preferred: argv is visible to every user)",
    )
    p.add_argument(
        "--grpc-reflection",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="serve gRPC reflection (default: on for a unix socket, off over TCP)",
    )
    p.add_argument(
        "--instance-id",
        help="set by pytgi-launcher: the health service pytgi.instance.ID answers SERVING, so the "
        "launcher knows the server on the socket is its own child",
    )
    p.add_argument(
        "--step-timeline",
        type=Path,
        help="rank 0 appends each Prefill/Decode step's phases (build, forward, choose, ahead, "
        "sync, emit, reply, device time) to this JSON-lines file; summarise it with "
        "`python -m pytgi_bench.compare.timeline_summary PATH`",
    )
    p.add_argument("--json-output", action="store_true", help="log JSON lines")
    p.add_argument("--log-level", "--logger-level", dest="log_level", default="INFO")
    p.add_argument("--otlp-endpoint", help="OTLP gRPC collector for traces")
    p.add_argument("--otlp-service-name", default="pytgi.shard")
    p.set_defaults(run=run_serve)


# Other modules append their own registration function here.
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_serve_command, add_download_command, add_ctl_command,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pytgi-shard", description="pytgi model shard")
    add_version_flag(parser)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for register in SUBCOMMANDS:
        register(subparsers)
    return parser


def settings_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> ShardSettings:
    """The one place that reads the environment: unset flags take their variable's value."""
    values = {}
    for field, (var, kind) in ENV_FALLBACKS.items():
        value = getattr(args, field)
        if value is None and env.get(var):
            try:
                value = kind(env[var])
            except ValueError as e:
                raise ValueError(f"{var}={env[var]!r} is not a valid {kind.__name__}") from e
        if value is not None:
            values[field] = value
    graphs = _cuda_graphs(args, env)
    if graphs is not None:
        values["cuda_graphs"] = graphs
    if args.cpu_graphs is not None:
        values["cpu_graphs"] = parse_cuda_graphs(args.cpu_graphs, "--cpu-graphs")
    quantize = _quantize(args, env)
    if quantize is not None:
        values["quantize"] = quantize
    return ShardSettings(
        model_path=args.model_path,
        uds_path=None if args.port is not None else (args.uds_path or DEFAULT_UDS_PATH),
        port=args.port,
        advertise_address=args.advertise_address,
        dtype=args.dtype,
        trust_remote_code=args.trust_remote_code,
        attention=args.attention,
        disable_custom_kernels=args.disable_custom_kernels or _env_switch(
            env, "DISABLE_CUSTOM_KERNELS"
        ),
        lora_runtime_updates=args.enable_lora_runtime_updates or _env_switch(
            env, "ENABLE_LORA_RUNTIME_UPDATES"
        ),
        block_size=args.block_size,
        max_total_tokens=args.max_total_tokens,
        overlap=args.overlap,
        grammar_thread=args.grammar_thread,
        grpc_reflection=args.grpc_reflection,
        instance_id=args.instance_id,
        step_timeline=args.step_timeline,
        json_output=args.json_output,
        log_level=args.log_level,
        otlp_endpoint=args.otlp_endpoint,
        otlp_service_name=args.otlp_service_name,
        **values,
    )


def _env_switch(env: Mapping[str, str], var: str) -> bool:
    """A switch's environment form (TGI's launcher writes DISABLE_CUSTOM_KERNELS=True)."""
    if not env.get(var, "").strip():
        return False
    try:
        return parse_bool(env[var])
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"{var}: {e}") from None


def _cuda_graphs(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[int, ...] | None:
    """--cuda-graphs, else CUDA_GRAPHS (TGI's comma list), else None: the default."""
    if args.cuda_graphs is not None:
        return parse_cuda_graphs(args.cuda_graphs)
    if env.get("CUDA_GRAPHS"):
        return parse_cuda_graphs(env["CUDA_GRAPHS"], "CUDA_GRAPHS")
    return None


def _quantize(args: argparse.Namespace, env: Mapping[str, str]) -> str | None:
    """--quantize, else QUANTIZE (TGI's variable), else None: the checkpoint's own."""
    if args.quantize is not None:
        return str(args.quantize)
    if env.get("QUANTIZE"):
        try:
            return parse_quantize(env["QUANTIZE"])
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"QUANTIZE: {e}") from None
    return None


def run_serve(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args, os.environ)
    except ValueError as e:
        print(f"pytgi-shard serve: error: {e}", file=sys.stderr)
        return 2
    configure_logging(settings.json_output, settings.log_level, settings.rank)
    # Heavy imports after argument parsing, so `--help` and bad flags answer at once.
    from pytgi_shard.service.server import serve
    from pytgi_shard.service.socket_guard import SocketInUse, claim_socket
    from pytgi_shard.service.startup import StartupRefused, load_engine, peer_urls
    from pytgi_shard.service.timeline_file import TimelineFile
    from pytgi_shard.service.tracing import server_interceptors, setup_tracing

    if settings.socket_path is not None:
        # Before loading anything: a second instance on this host fails at once, harmlessly.
        try:
            claim_socket(settings.socket_path)
        except SocketInUse as e:
            log.error("shard %d cannot start: %s", settings.rank, e)
            return 1
    provider = (
        setup_tracing(settings.otlp_endpoint, settings.otlp_service_name)
        if settings.otlp_endpoint
        else None
    )
    engine = None
    timeline_file = None
    try:
        engine = load_engine(settings)
        if engine.timeline is not None and settings.step_timeline is not None:
            timeline_file = TimelineFile(engine.timeline, settings.step_timeline).start()
        urls = peer_urls(settings, engine.dist)
        asyncio.run(serve(settings, engine, urls, server_interceptors(provider)))
    except (SocketInUse, QuantizationError, StartupRefused) as e:
        # One line says it all (no traceback): the launcher shows it as the reason.
        log.error("shard %d cannot start: %s", settings.rank, e)
        return 1
    except Exception:
        log.exception("shard %d failed", settings.rank)
        return 1
    finally:
        if timeline_file is not None:
            timeline_file.close()
        if engine is not None:
            engine.dist.close()
        if provider is not None:
            provider.shutdown()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())

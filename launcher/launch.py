"""What `pytgi-launcher` does once its flags are parsed: resolve, plan, supervise."""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import Mapping
from pathlib import Path

from pytgi_launcher.logs import LogSink, configure_logging
from pytgi_launcher.settings import LauncherSettings
from pytgi_launcher.supervisor import Plan, Supervisor
from pytgi_shard.quantization.errors import QuantizationError
from pytgi_shard.quantization.resolution import resolve_quantization
from pytgi_shard.weights.resolution import ModelNotFound, WeightsSource, hub_token, resolve_model

# Device nodes a GPU driver creates (NVIDIA; ROCm's kfd; WSL's dxg): with none of them there is
# no GPU to find, and the launcher need not import torch (~1.6 s before any shard starts) to say so.
GPU_DEVICE_NODES = ("nvidiactl", "nvidia0", "kfd", "dxg")


def driver_present(dev: Path = Path("/dev")) -> bool:
    return any((dev / node).exists() for node in GPU_DEVICE_NODES)


def visible_gpus(dev: Path = Path("/dev")) -> tuple[int, str]:
    """(count, name of GPU 0) as torch sees them; CUDA_VISIBLE_DEVICES narrows both."""
    if not driver_present(dev):
        return 0, ""
    import torch

    if not torch.cuda.is_available():
        return 0, ""
    return torch.cuda.device_count(), torch.cuda.get_device_name(0)


def compute_type(num_shard: int, gpu_name: str) -> str:
    """TGI's x-compute-type value: "<num_shard>-<gpu name, lower case, dashes>"."""
    device = gpu_name.lower().replace(" ", "-") if gpu_name else "cpu"
    return f"{num_shard}-{device}"


def port_in_use(hostname: str, port: int) -> bool:
    """Whether the router could not bind (hostname, port): checked before any model loads."""
    family = socket.AF_INET6 if ":" in hostname else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((hostname.strip("[]"), port))
        except OSError:
            return True
    return False


def free_port(host: str) -> int:
    """A port the OS has free on `host` now: the default rendezvous port. A fixed default (TGI's
    29500) makes a second instance on the host collide with the first one's process group."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        try:
            sock.bind((host.strip("[]"), 0))
        except OSError:
            sock.bind(("", 0))
        return int(sock.getsockname()[1])


def quantization_in_use(model_path: Path, flag: str | None) -> str:
    """What the shards will run, for the launcher's log: the checkpoint's quantization and
    --quantize reconciled as each shard will (a QuantizationError before anything starts)."""
    try:
        config = json.loads((model_path / "config.json").read_text())
    except ValueError as e:
        raise QuantizationError(f"{model_path / 'config.json'} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise QuantizationError(f"{model_path / 'config.json'} is not a JSON object")
    spec = resolve_quantization(model_path, config, flag)
    return "no quantization" if spec is None else f"quantization {spec.describe()}"


def fail(message: str) -> int:
    print(f"pytgi-launcher: error: {message}", file=sys.stderr)
    return 1


def launch(settings: LauncherSettings, environ: Mapping[str, str]) -> int:
    sink = LogSink(settings.json_output)
    log = configure_logging(sink, environ.get("LOG_LEVEL", "INFO").upper())
    source = WeightsSource(
        model_id=settings.model_id,
        revision=settings.revision,
        huggingface_hub_cache=settings.huggingface_hub_cache,
        weights_cache_override=settings.weights_cache_override,
        token=hub_token(environ),
    )
    if port_in_use(settings.hostname, settings.port):
        return fail(f"cannot serve on {settings.hostname}:{settings.port}: the address is in use "
                    "(choose another --port)")
    try:
        model_path = resolve_model(source)
    except ModelNotFound as e:
        return fail(str(e))
    gpus, gpu_name = visible_gpus()
    try:
        num_shard = settings.num_shards(gpus)
    except ValueError as e:
        return fail(str(e))
    dtype = settings.resolved_dtype(on_gpu=gpus > 0)
    try:
        quantization = quantization_in_use(model_path, settings.quantize)
    except QuantizationError as e:
        return fail(str(e))
    log.info("model %s at %s: %d shard(s), %s, %s", settings.model_id, model_path, num_shard,
             dtype, quantization)
    plan = Plan(settings, model_path, num_shard, dtype, compute_type(num_shard, gpu_name), environ,
                master_port=settings.master_port or free_port(settings.master_addr),
                quantization=quantization)
    return Supervisor(plan, sink, log).run()

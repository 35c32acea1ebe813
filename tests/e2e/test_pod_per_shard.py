"""The Kubernetes topology on one machine: shards started by hand as independent processes on TCP
ports (as the StatefulSet's pods are: rank, world size and master address from the environment),
a router pointed only at rank 0's address, and operators' tools against the shards' gRPC.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from text_generation import Client

from pytgi_proto import generate_pb2, generate_pb2_grpc
from tests.router_process import RouterProcess

WORLD_SIZE = 2
START_TIMEOUT = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def health_status(address: str, service: str = "") -> int | None:
    """grpc.health.v1's answer for `service`, None when the shard does not answer."""
    with grpc.insecure_channel(address) as channel:
        try:
            return int(health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2).status)
        except grpc.RpcError:
            return None


def health_answers(address: str) -> bool:
    return health_status(address) is not None


def shard_script() -> str:
    return str(Path(sys.executable).with_name("pytgi-shard"))


@dataclass
class Pods:
    addresses: list[str]
    procs: list[subprocess.Popen[bytes]]
    logs: list[Path]

    def output(self) -> str:
        return "\n".join(f"--- rank {r}\n{p.read_text(errors='replace')}"
                         for r, p in enumerate(self.logs) if p.exists())


@pytest.fixture(scope="module")
def pods(tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pods]:
    model = tiny_model("llama")
    workdir = tmp_path_factory.mktemp("pods")
    master_port = free_port()
    ports = [free_port() for _ in range(WORLD_SIZE)]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    procs, logs = [], []
    for rank, port in enumerate(ports):
        # What deploy/kubernetes/shards.yaml gives each pod: identity through the environment.
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(WORLD_SIZE),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port)}
        log = workdir / f"rank-{rank}.log"
        logs.append(log)
        with log.open("wb") as out:
            procs.append(subprocess.Popen(
                [shard_script(), "serve", str(model), "--port", str(port),
                 "--advertise-address", addresses[rank],
                 # Reflection is off over TCP unless asked: rank 1 asks, rank 0 does not.
                 *(["--grpc-reflection"] if rank == 1 else [])],
                env=env, stdout=out, stderr=subprocess.STDOUT,
            ))
    pods = Pods(addresses, procs, logs)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        # Up, not SERVING: grpc.health.v1 says SERVING only once a router ran Warmup.
        while not all(health_answers(a) for a in addresses):
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                raise AssertionError(f"shards did not start:\n{pods.output()}")
            time.sleep(0.2)
        yield pods
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def ctl(address: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([shard_script(), "ctl", address, *args], capture_output=True, text=True,
                          timeout=60)


def test_router_on_rank_zero_generates_like_transformers(
    pods: Pods, tiny_model: Callable[..., Path]
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = tiny_model("llama")
    prompt = "Paged attention stores"
    with RouterProcess(pods.addresses[0], model_dir) as router:
        response = Client(router.url, timeout=60).generate(prompt, max_new_tokens=10)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = tok(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=tok.pad_token_id)
    assert [t.id for t in response.details.tokens] == out[0, ids.shape[1]:].tolist()


def test_service_discovery_lists_every_rank(pods: Pods) -> None:
    done = ctl(pods.addresses[0], "discover")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == pods.addresses


def test_ctl_info_health_clear_cache(pods: Pods) -> None:
    info = ctl(pods.addresses[1], "info")
    assert info.returncode == 0, info.stderr
    fields = json.loads(info.stdout)
    assert fields["world_size"] == WORLD_SIZE and fields["model_type"] == "llama"
    health = ctl(pods.addresses[0], "health")
    assert (health.returncode, health.stdout.strip()) == (0, "healthy")
    cleared = ctl(pods.addresses[0], "clear-cache")
    assert (cleared.returncode, cleared.stdout.strip()) == (0, "cleared")


def test_ctl_reports_an_unreachable_shard() -> None:
    done = ctl(f"127.0.0.1:{free_port()}", "health", "--timeout", "2")
    assert done.returncode == 1
    assert "health on 127.0.0.1:" in done.stderr and "UNAVAILABLE" in done.stderr


def warm_up(pods: Pods) -> None:
    """What the router does first: Warmup on every rank at once (they agree on the cache size)."""
    request = generate_pb2.WarmupRequest(max_prefill_tokens=256, max_batch_total_tokens=2048)
    channels = [grpc.insecure_channel(a) for a in pods.addresses]
    calls = [generate_pb2_grpc.TextGenerationServiceStub(c).Warmup.future(request, timeout=60)
             for c in channels]
    for call in calls:
        call.result()
    for channel in channels:
        channel.close()


def test_standard_grpc_health_and_reflection(pods: Pods) -> None:
    """What Kubernetes' grpc probes and grpcurl use; reflection only where asked over TCP."""
    warm_up(pods)
    serving = health_pb2.HealthCheckResponse.SERVING
    assert [health_status(a) for a in pods.addresses] == [serving, serving]
    with grpc.insecure_channel(pods.addresses[0]) as channel:
        replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        with pytest.raises(grpc.RpcError) as off:
            list(replies)
        assert off.value.code() == grpc.StatusCode.UNIMPLEMENTED
    with grpc.insecure_channel(pods.addresses[1]) as channel:
        replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        services = {s.name for r in replies for s in r.list_services_response.service}
    assert {"pytgi.generate.v1.TextGenerationService", "grpc.health.v1.Health"} <= services

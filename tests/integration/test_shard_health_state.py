"""grpc.health.v1 follows the engine (issue 11 item 9), and a Warmup cannot resize a cache that
holds live batches (item 1), over real gRPC against a real shard process.

The shard runs the real CLI; only Engine.health is wrapped so that it fails while a flag file
exists, as an engine that cannot run a forward does (no device fault can be provoked on a CPU).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pytgi_proto import generate_pb2 as pb
from pytgi_proto import generate_pb2_grpc
from tests.shard_process import ShardProcesses

SERVICE = "pytgi.generate.v1.TextGenerationService"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
WARMUP = pb.WarmupRequest(max_prefill_tokens=64, max_batch_total_tokens=1024)

SHARD = """
import os, sys
from pytgi_shard.service import cli
from pytgi_shard.engine.engine import Engine

real_health = Engine.health

def health(self):
    if os.path.exists(os.environ["HEALTH_FAILS_WHILE"]):
        raise RuntimeError("the engine cannot run a forward")
    real_health(self)

Engine.health = health
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def shard(
    tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ShardProcesses, Path]]:
    workdir = tmp_path_factory.mktemp("health")
    # Unix socket paths must stay short: a directory under /tmp, as tests/shard_process.py does.
    sockets = Path(tempfile.mkdtemp(prefix="pytgi-h-", dir="/tmp"))
    shards = ShardProcesses(tiny_model("llama"), 1, sockets, str(sockets / "s"), [])
    flag = workdir / "health-fails"
    with shards.log_path(0).open("wb") as log:
        shards.procs.append(subprocess.Popen(
            [sys.executable, "-c", SHARD, "serve", str(shards.model_path),
             "--uds-path", str(shards.uds_path), "--instance-id", "abc"],
            stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "HEALTH_FAILS_WHILE": str(flag), "OMP_NUM_THREADS": "1"}))
    try:
        shards.wait_ready()
        yield shards, flag
    finally:
        shards.cleanup()


def status(channel: grpc.Channel, service: str) -> int:
    reply = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=10)
    return int(reply.status)


def test_health_is_not_serving_until_warmup_and_follows_the_health_rpc(
    shard: tuple[ShardProcesses, Path],
) -> None:
    processes, flag = shard
    with grpc.insecure_channel(processes.urls[0]) as channel:
        stub = generate_pb2_grpc.TextGenerationServiceStub(channel)
        # Loaded and listening, not warmed up: probes must not send traffic yet.
        assert status(channel, "") == NOT_SERVING and status(channel, SERVICE) == NOT_SERVING
        # The launcher's question, answered only for the id it gave this process.
        assert status(channel, "pytgi.instance.abc") == SERVING
        with pytest.raises(grpc.RpcError) as unknown:
            status(channel, "pytgi.instance.other")
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        # A refused Warmup (checked before anything changed) does not make it SERVING.
        with pytest.raises(grpc.RpcError):
            stub.Warmup(pb.WarmupRequest(max_prefill_tokens=64, max_input_tokens=10,
                                         max_total_tokens=10), timeout=60)
        assert status(channel, "") == NOT_SERVING
        stub.Warmup(WARMUP, timeout=60)
        assert status(channel, "") == SERVING and status(channel, SERVICE) == SERVING
        # The engine breaks: the Health RPC fails and the probes see it.
        flag.touch()
        with pytest.raises(grpc.RpcError) as failed:
            stub.Health(pb.HealthRequest(), timeout=30)
        assert failed.value.code() == grpc.StatusCode.INTERNAL
        assert status(channel, "") == NOT_SERVING and status(channel, SERVICE) == NOT_SERVING
        # ... and recovers.
        flag.unlink()
        stub.Health(pb.HealthRequest(), timeout=30)
        assert status(channel, "") == SERVING


def test_warmup_is_refused_while_live_batches_hold_the_cache(
    shard: tuple[ShardProcesses, Path],
) -> None:
    processes, _ = shard
    with grpc.insecure_channel(processes.urls[0]) as channel:
        stub = generate_pb2_grpc.TextGenerationServiceStub(channel)
        stub.Warmup(WARMUP, timeout=60)
        request = pb.Request(id=1, input_ids=[5, 6, 7], blocks=[1],
                             stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=8))
        live = stub.Prefill(pb.PrefillRequest(batch=pb.Batch(id=7, requests=[request], size=1)),
                            timeout=60).batch
        with pytest.raises(grpc.RpcError) as refused:
            stub.Warmup(WARMUP, timeout=60)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "Warmup refused: 1 live batch(es)" in (refused.value.details() or "")
        # The live batch was not touched: it decodes on, and the shard stays SERVING.
        step = stub.Decode(pb.DecodeRequest(batches=[live]), timeout=60)
        assert list(step.batch.request_ids) == [1]
        assert status(channel, "") == SERVING
        stub.ClearCache(pb.ClearCacheRequest(), timeout=30)
        stub.Warmup(WARMUP, timeout=60)

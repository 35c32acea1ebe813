"""Shard gRPC over TCP with a shared token (issue 11 item 10), over real gRPC against a real shard
process started as deploy/kubernetes runs it (TCP port, SHARD_TOKEN in the environment):

- a call without the token, or with a wrong one, ends UNAUTHENTICATED before the engine;
- the router's client sends it and works; without it the router cannot connect;
- grpc.health.v1 stays open (Kubernetes' probes send no metadata);
- reflection is off over TCP unless --grpc-reflection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pytgi_proto import generate_pb2 as pb
from pytgi_proto import generate_pb2_grpc
from pytgi_router.core.shard_client import ShardCallError, ShardClient
from pytgi_shard.service.ctl import call as ctl_call
from tests.shard_process import ShardProcesses, start_shards

TOKEN = "s3cret-shard-token"


@pytest.fixture(scope="module")
def shard(tiny_model: Callable[..., Path]) -> Iterator[ShardProcesses]:
    with start_shards(tiny_model("llama"), tcp=True, env={"SHARD_TOKEN": TOKEN}) as processes:
        yield processes


def info(address: str, token: str | None) -> pb.InfoResponse:
    metadata = None if token is None else (("authorization", f"Bearer {token}"),)
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.TextGenerationServiceStub(channel)
        reply: pb.InfoResponse = stub.Info(pb.InfoRequest(), timeout=10, metadata=metadata)
        return reply


@pytest.mark.parametrize("token", [None, "wrong", TOKEN[:-1], TOKEN + "x", ""])
def test_calls_without_the_right_token_are_unauthenticated(
    shard: ShardProcesses, token: str | None
) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        info(shard.urls[0], token)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_right_token_is_served_and_health_stays_open(shard: ShardProcesses) -> None:
    assert info(shard.urls[0], TOKEN).model_type == "llama"
    with grpc.insecure_channel(shard.urls[0]) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING  # not warmed up yet


def test_pytgi_shard_ctl_uses_the_token(shard: ShardProcesses) -> None:
    assert ctl_call(shard.urls[0], "discover", token=TOKEN) == shard.urls[0]
    with pytest.raises(grpc.RpcError) as refused:
        ctl_call(shard.urls[0], "discover")
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_reflection_is_off_over_tcp_by_default(shard: ShardProcesses) -> None:
    metadata = (("authorization", f"Bearer {TOKEN}"),)
    with grpc.insecure_channel(shard.urls[0]) as channel:
        replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10,
            metadata=metadata)
        with pytest.raises(grpc.RpcError) as off:
            list(replies)
    assert off.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_the_routers_client_sends_the_token(shard: ShardProcesses) -> None:
    async def scenario() -> None:
        client = await ShardClient.connect(shard.urls[0], timeout=10, token=TOKEN)
        try:
            assert (await client.info(timeout=10)).model_type == "llama"
            await client.clear_cache(timeout=10)
        finally:
            await client.close()
        with pytest.raises(ShardCallError, match="shard token"):
            await ShardClient.connect(shard.urls[0], timeout=10)
        with pytest.raises(ShardCallError, match="shard token"):
            await ShardClient.connect(shard.urls[0], timeout=10, token="wrong")

    asyncio.run(scenario())


def test_reflection_over_tcp_when_asked(tiny_model: Callable[..., Path]) -> None:
    model = tiny_model("llama")
    with (
        start_shards(model, tcp=True, extra_args=["--grpc-reflection"]) as s,
        grpc.insecure_channel(s.urls[0]) as channel,
    ):
        replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        services = {x.name for r in replies for x in r.list_services_response.service}
    assert "pytgi.generate.v1.TextGenerationService" in services

"""Real `pytgi-shard serve` processes driven over gRPC: two ranks (gloo) per model family.

Like the router, the tests send every call to every rank at once, read rank 0's answer and check
that both ranks answered the same. One rank is covered in-process by tests/unit/shard/engine/test_batch.py
and through real processes by the router's and launcher's tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from tokenizers import Tokenizer

from pytgi_proto import generate_pb2 as pb
from pytgi_proto import generate_pb2_grpc
from tests.hf_reference import hf_greedy
from tests.shard_process import ShardProcesses, start_shards

BLOCK = 16
PROMPT = "The quick brown fox"


class Shards:
    """A fan-out client: each call goes to every rank concurrently; rank 0's answer is returned."""

    def __init__(self, processes: ShardProcesses) -> None:
        self.processes = processes
        self.channels = [grpc.insecure_channel(url) for url in processes.urls]
        self.stubs = [generate_pb2_grpc.TextGenerationServiceStub(c) for c in self.channels]
        self.pool = ThreadPoolExecutor(max_workers=len(self.stubs))
        self.last_answers: list[Any] = []

    def call(self, rpc: str, request: Any) -> Any:
        futures = [self.pool.submit(getattr(s, rpc), request, timeout=60) for s in self.stubs]
        self.last_answers = [f.result() for f in futures]
        return self.last_answers[0]

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
        self.pool.shutdown()


def start(model: Path, world_size: int, tcp: bool, extra_args: list[str]) -> Shards:
    # Spans leave the shard within 50 ms instead of the default 5 s.
    env = {"OTEL_BSP_SCHEDULE_DELAY": "50"}
    shards = Shards(start_shards(model, world_size, tcp=tcp, extra_args=extra_args, env=env))
    try:
        shards.call("Warmup", pb.WarmupRequest(max_prefill_tokens=256, max_batch_total_tokens=2048))
    except BaseException:
        stop(shards)
        raise
    return shards


def stop(shards: Shards) -> None:
    """Stops the ranks; they must exit cleanly and remove their sockets."""
    processes = shards.processes
    shards.close()
    codes = processes.stop()
    sockets = [Path(u.removeprefix("unix://")) for u in processes.urls if u.startswith("unix:")]
    output = processes.output(0)
    processes.cleanup()
    assert codes == [0] * processes.world_size, f"unclean exit {codes}:\n{output}"
    assert not any(s.exists() for s in sockets)


# Two ranks of each family; mistral's over TCP, the others over unix sockets; qwen2's export
# traces to the test's collector.
TCP = {"llama": False, "mistral": True, "qwen2": False}
TRACED = "qwen2"


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """A minimal OTLP/gRPC trace collector: keeps (service, span name, trace id, parent id)."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, str, str]] = []

    def Export(self, request: Any, context: Any) -> Any:
        for resource in request.resource_spans:
            attrs = {a.key: a.value.string_value for a in resource.resource.attributes}
            for scope in resource.scope_spans:
                self.spans.extend(
                    (
                        attrs.get("service.name", ""),
                        s.name,
                        s.trace_id.hex(),
                        s.parent_span_id.hex(),
                    )
                    for s in scope.spans
                )
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture(scope="module")
def collector() -> Iterator[tuple[Collector, int]]:
    found = Collector()
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(found, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield found, port
    server.stop(None)


@pytest.fixture(scope="module")
def timeline_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The traced family's --step-timeline file (both ranks are given it; rank 0 writes)."""
    return tmp_path_factory.mktemp("timeline") / "steps.jsonl"


@pytest.fixture(scope="module")
def servers(
    tiny_model: Callable[..., Path], collector: tuple[Collector, int], timeline_path: Path
) -> Iterator[Callable[[str], Shards]]:
    """Two-rank servers by family, started on first use and shared by the module's tests."""
    running: dict[str, Shards] = {}
    otlp = ["--otlp-endpoint", f"http://127.0.0.1:{collector[1]}", "--otlp-service-name", "traced",
            "--step-timeline", str(timeline_path)]

    def get(family: str) -> Shards:
        if family not in running:
            extra = otlp if family == TRACED else []
            running[family] = start(tiny_model(family), 2, TCP[family], extra)
        return running[family]

    yield get
    for shards in running.values():
        stop(shards)


@pytest.fixture
def llama(servers: Callable[[str], Shards]) -> Shards:
    return servers("llama")


def prompt_ids(model: Path, text: str = PROMPT) -> list[int]:
    return Tokenizer.from_file(str(model / "tokenizer.json")).encode(text).ids


def make_request(
    rid: int, ids: list[int], max_new: int, first_block: int = 1, **fields: Any
) -> pb.Request:
    blocks = -(-(len(ids) + max_new) // BLOCK)
    return pb.Request(
        id=rid,
        input_ids=ids,
        stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=max_new),
        blocks=list(range(first_block, first_block + blocks)),
        **fields,
    )


def generate(
    shards: Shards, requests: list[pb.Request], batch_id: int = 1
) -> dict[int, list[pb.Generation]]:
    out: dict[int, list[pb.Generation]] = {r.id: [] for r in requests}
    response = shards.call(
        "Prefill", pb.PrefillRequest(batch=pb.Batch(id=batch_id, requests=requests))
    )
    while True:
        assert _ranks_agree(shards)
        for g in response.generations:
            out[g.request_id].append(g)
        if not response.HasField("batch"):
            return out
        response = shards.call("Decode", pb.DecodeRequest(batches=[response.batch]))


def _ranks_agree(shards: Shards) -> bool:
    """Ranks agree on everything but their own timings."""

    def strip(answer: Any) -> Any:
        copy = type(answer)()
        copy.CopyFrom(answer)
        for name in ("forward_ns", "decode_ns", "total_ns", "concat_ns"):
            copy.ClearField(name)
        return copy

    first = strip(shards.last_answers[0])
    return all(strip(a) == first for a in shards.last_answers[1:])


def check_greedy(shards: Shards) -> None:
    model = shards.processes.model_path
    ids = prompt_ids(model)
    expected, expected_lps = hf_greedy(model, ids, 10)
    generations = generate(shards, [make_request(7, ids, 10)])[7]
    assert [g.tokens.ids[0] for g in generations] == expected
    torch.testing.assert_close(
        [g.tokens.logprobs[0] for g in generations], expected_lps, rtol=1e-4, atol=1e-4
    )
    assert generations[-1].generated_text.generated_tokens == len(expected)


@pytest.mark.parametrize("family", list(TCP))
def test_two_ranks_greedy_matches_transformers_and_ranks_agree(
    servers: Callable[[str], Shards], family: str
) -> None:
    two_ranks = servers(family)
    check_greedy(two_ranks)
    info = two_ranks.call("Info", pb.InfoRequest())
    assert info.world_size == 2
    urls = two_ranks.call("ServiceDiscovery", pb.ServiceDiscoveryRequest()).urls
    # Over TCP every rank learnt the others' advertised addresses at start-up.
    assert list(urls) == two_ranks.processes.urls
    assert all(list(a.urls) == list(urls) for a in two_ranks.last_answers)
    two_ranks.call("Health", pb.HealthRequest())


def test_info_health_discovery_and_standard_services(llama: Shards) -> None:
    info = llama.call("Info", pb.InfoRequest())
    assert (info.model_type, info.world_size, info.block_size) == ("llama", 2, BLOCK)
    assert (info.dtype, info.device_type, info.requires_padding) == ("float32", "cpu", False)
    assert info.vocab_size == 384 and info.max_position_embeddings == 256
    assert info.attention_impl == "reference" and not info.HasField("window_size")
    llama.call("Health", pb.HealthRequest())
    urls = llama.call("ServiceDiscovery", pb.ServiceDiscoveryRequest()).urls
    assert list(urls) == llama.processes.urls
    channel = llama.channels[0]
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"pytgi.generate.v1.TextGenerationService", "grpc.health.v1.Health"} <= services


def expect_error(shards: Shards, code: grpc.StatusCode, match: str, rpc: str, request: Any) -> None:
    with pytest.raises(grpc.RpcError) as info:
        shards.call(rpc, request)
    assert info.value.code() == code
    assert match in info.value.details()


def test_bad_calls_get_grpc_errors_and_the_server_keeps_serving(llama: Shards) -> None:
    ids = prompt_ids(llama.processes.model_path)
    invalid = grpc.StatusCode.INVALID_ARGUMENT

    def prefill(*requests: pb.Request) -> pb.PrefillRequest:
        return pb.PrefillRequest(batch=pb.Batch(id=50, requests=requests))

    expect_error(llama, grpc.StatusCode.NOT_FOUND, "batch 404 not found", "Decode",
                 pb.DecodeRequest(batches=[pb.CachedBatch(id=404)]))  # fmt: skip
    # Blocks must hold the tokens computed now and the next one (more arrive as BlockGrants).
    for keep in (0, 1):
        short = make_request(1, ids * 8, 40)
        del short.blocks[keep:]
        expect_error(llama, invalid, "needs", "Prefill", prefill(short))
    expect_error(llama, invalid, "max_new_tokens", "Prefill", prefill(make_request(1, ids, 0)))
    expect_error(llama, invalid, "input_ids is empty", "Prefill", prefill(make_request(1, [], 3)))
    expect_error(llama, invalid, "vocabulary", "Prefill", prefill(make_request(1, [1, 384], 3)))
    expect_error(llama, invalid, "block 5000", "Prefill",
                 prefill(make_request(1, ids, 3, first_block=5000)))  # fmt: skip
    expect_error(llama, grpc.StatusCode.NOT_FOUND, "batch 9", "FilterBatch",
                 pb.FilterBatchRequest(batch_id=9, request_ids=[1]))  # fmt: skip
    llama.call("ClearCache", pb.ClearCacheRequest())
    # Still serving, and seeded sampling gives the same tokens twice.
    params = pb.NextTokenChooserParameters(do_sample=True, seed=42, temperature=1.3)
    runs = [
        generate(llama, [make_request(3, ids, 6, parameters=params)], batch_id=b)[3]
        for b in (60, 61)
    ]
    assert [g.tokens.ids[0] for g in runs[0]] == [g.tokens.ids[0] for g in runs[1]]
    assert runs[0][-1].generated_text.seed == 42


def test_prefill_onto_a_cached_batch_then_filter_over_grpc(llama: Shards) -> None:
    model = llama.processes.model_path
    a = make_request(1, prompt_ids(model, "Hello world!"), 6, first_block=1, top_n_tokens=2)
    b = make_request(
        2, prompt_ids(model, "To be, or not"), 6, first_block=10, prefill_logprobs=True
    )
    alone = {r.id: [g.tokens.ids[0] for g in generate(llama, [r], batch_id=100 + r.id)[r.id]]
             for r in (a, b)}  # fmt: skip
    first = llama.call("Prefill", pb.PrefillRequest(batch=pb.Batch(id=1, requests=[a])))
    second = llama.call(
        "Prefill", pb.PrefillRequest(batch=pb.Batch(id=2, requests=[b]), cached_batch=first.batch)
    )
    assert list(second.batch.request_ids) == [1, 2] and second.HasField("concat_ns")
    # The mixed step: the cached request's next token, then the newcomer's first.
    assert [g.request_id for g in second.generations] == [1, 2]
    assert len(second.generations[1].prefill_tokens.ids) == len(b.input_ids)
    step = llama.call("Decode", pb.DecodeRequest(batches=[second.batch]))
    assert len(step.generations[0].top_tokens[0].ids) >= 2
    kept = llama.call("FilterBatch", pb.FilterBatchRequest(batch_id=1, request_ids=[2])).batch
    assert list(kept.request_ids) == [2] and kept.size == 1
    tokens = [second.generations[1].tokens.ids[0], step.generations[1].tokens.ids[0]]
    while kept.size:
        step = llama.call("Decode", pb.DecodeRequest(batches=[kept]))
        tokens.append(step.generations[0].tokens.ids[0])
        if not step.HasField("batch"):
            break
        kept = step.batch
    assert tokens == alone[2]


def test_shard_spans_join_the_callers_trace(
    servers: Callable[[str], Shards], collector: tuple[Collector, int]
) -> None:
    shards = servers(TRACED)
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    metadata = (("traceparent", f"00-{trace_id}-{parent}-01"),)
    ids = prompt_ids(shards.processes.model_path)
    request = pb.PrefillRequest(batch=pb.Batch(id=5, requests=[make_request(1, ids, 1)]))
    futures = [shards.pool.submit(s.Prefill, request, metadata=metadata) for s in shards.stubs]
    assert all(not f.result().HasField("batch") for f in futures)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        ours = [s for s in collector[0].spans if s[2] == trace_id]
        if len([s for s in ours if s[1] in ("forward", "sample")]) >= 4:
            break
        time.sleep(0.05)
    rpc = [s for s in ours if s[1].endswith("/Prefill")]
    assert len(rpc) == 2 and all(s[0] == "traced" and s[3] == parent for s in rpc)
    inner = {s[1] for s in ours if s[3] != parent}
    assert {"forward", "sample"} <= inner


def test_rank_0_writes_each_step_to_its_step_timeline(
    servers: Callable[[str], Shards], timeline_path: Path
) -> None:
    """--step-timeline through a real shard: rank 0 alone writes (one header), every Prefill
    and Decode a line within the writer's half second, Warmup none."""
    from pytgi_bench.compare.timeline_summary import PHASES, read_timeline

    shards = servers(TRACED)
    ids = prompt_ids(shards.processes.model_path)
    before = time.perf_counter_ns()
    generate(shards, [make_request(1, ids, 3), make_request(2, ids[:2], 3, first_block=9)])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        ours = [r for r in read_timeline(timeline_path) if r["t_ns"] >= before]
        if len(ours) >= 3:
            break
        time.sleep(0.1)
    assert [(r["kind"], r["requests"]) for r in ours] == [("prefill", 2), ("decode", 2),
                                                          ("decode", 2)]
    assert ours[0]["tokens"] == len(ids) + 2
    assert all(sum(r[f"{p}_ns"] for p in PHASES) == r["end_ns"] - r["t_ns"] for r in ours)
    headers = [line for line in timeline_path.read_text().splitlines() if "step_timeline" in line]
    assert len(headers) == 1

"""Decode CUDA graphs: bucketing, the padded buffers, the --cuda-graphs flag, the engine hook.

On CPU the runner's eager path runs the same padding the graphs replay; it must give every real
request the logits of the unpadded forward. The CUDA test captures, replays and compares with the
eager forward (on the Triton backend when it exists: the one production captures).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from pytgi_launcher.cli import parse_settings
from pytgi_launcher.commands import shard_argv
from pytgi_proto import generate_pb2 as pb
from pytgi_shard.attention.backend import BACKENDS
from pytgi_shard.attention.kv_cache import SCRATCH_SLOT
from pytgi_shard.device.capabilities import resolve_capabilities
from pytgi_shard.engine.decode_graphs import (
    DecodeGraphRunner,
    bucket_for,
    resolve_buckets,
)
from pytgi_shard.engine.engine import Engine
from pytgi_shard.engine.graphs_off import graphs_off_reason
from pytgi_shard.engine.step_inputs import ForwardInputs
from pytgi_shard.service.startup import load_engine
from pytgi_shard.settings import DEFAULT_CUDA_GRAPHS, ShardSettings, parse_cuda_graphs
from tests.unit.shard.engine.test_batch import batch_of, request
from tests.unit.shard.engine.test_engine import MIXED, Run
from tests.unit.shard.service.test_cli import parse

BLOCK = 4
BUCKETS = (1, 2, 4, 8)
MAX_BLOCKS = 16


# --- bucketing -------------------------------------------------------------------------------


def test_a_batch_takes_the_smallest_bucket_that_holds_it() -> None:
    assert [bucket_for(BUCKETS, n) for n in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
    assert bucket_for(BUCKETS, 9) is None and bucket_for((), 1) is None


def test_buckets_above_the_max_batch_size_collapse_onto_it() -> None:
    assert resolve_buckets(DEFAULT_CUDA_GRAPHS, 0) == DEFAULT_CUDA_GRAPHS
    assert resolve_buckets(DEFAULT_CUDA_GRAPHS, 100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert resolve_buckets((8, 1, 4), 4) == (1, 4)
    assert resolve_buckets((1, 2), 1000) == (1, 2)


# --- the --cuda-graphs flag ------------------------------------------------------------------


def test_cuda_graphs_takes_tgi_comma_lists() -> None:
    assert parse_cuda_graphs("1,2,4,8") == (1, 2, 4, 8)
    assert parse_cuda_graphs("8, 2,2") == (2, 8)
    assert parse_cuda_graphs("0") == ()


@pytest.mark.parametrize("text", ["", "a", "1,,2", "0,4", "-1", "2.5"])
def test_bad_cuda_graphs_name_the_flag_and_the_format(text: str) -> None:
    with pytest.raises(ValueError, match=r"--cuda-graphs takes a comma list"):
        parse_cuda_graphs(text)


def test_settings_refuse_sizes_below_one() -> None:
    with pytest.raises(ValueError, match=r"--cuda-graphs sizes must be >= 1"):
        ShardSettings(model_path=Path("/m"), cuda_graphs=(0, 4))


def test_the_shard_reads_cuda_graphs_from_its_flag_then_the_environment() -> None:
    assert parse().cuda_graphs == DEFAULT_CUDA_GRAPHS
    assert parse("--cuda-graphs", "4,1").cuda_graphs == (1, 4)
    assert parse(env={"CUDA_GRAPHS": "0"}).cuda_graphs == ()
    assert parse("--cuda-graphs", "2", env={"CUDA_GRAPHS": "0"}).cuda_graphs == (2,)
    with pytest.raises(ValueError, match="CUDA_GRAPHS takes a comma list"):
        parse(env={"CUDA_GRAPHS": "all"})


def test_the_launcher_passes_cuda_graphs_to_every_shard(capsys: pytest.CaptureFixture[str]) -> None:
    model = Path("/m")
    unset = shard_argv(parse_settings([], {}), model, 0, 1, "float32")
    assert "--cuda-graphs" not in unset
    for settings in (
        parse_settings(["--cuda-graphs", "1,2,4"], {}),
        parse_settings([], {"CUDA_GRAPHS": "1,2,4"}),
    ):
        argv = shard_argv(settings, model, 1, 2, "float32")
        assert argv[argv.index("--cuda-graphs") + 1] == "1,2,4"
    with pytest.raises(SystemExit):
        parse_settings(["--cuda-graphs", "1;2"], {})
    assert "--cuda-graphs takes a comma list" in capsys.readouterr().err


# --- the runner on CPU -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_model: Callable[..., Path]) -> Iterator[Engine]:
    settings = ShardSettings(model_path=tiny_model("llama"), block_size=BLOCK)
    built = load_engine(settings)
    built.warmup(pb.WarmupRequest(max_prefill_tokens=128, max_batch_total_tokens=2048))
    yield built
    built.runner.decode_graphs = None
    built.clear(None)


def decode_inputs(engine: Engine, size: int, batch_id: int, first_block: int = 1) -> ForwardInputs:
    """Prefills `size` requests of different lengths (1 to 4 blocks each, from `first_block` on)
    and returns the decode step's inputs of the cached batch."""
    requests, next_block = [], first_block
    for i in range(size):
        prompt = [(3 + 5 * i + 7 * j) % 300 + 3 for j in range(2 + (5 * i) % 13)]
        blocks = -(-(len(prompt) + 2) // BLOCK)
        requests.append(request(
            i, prompt, max_new=3, block_size=BLOCK, ignore_eos=True,
            blocks=list(range(next_block, next_block + blocks)),
        ))  # fmt: skip
        next_block += blocks
    engine.prefill(pb.PrefillRequest(batch=batch_of(*requests, batch_id=batch_id)))
    return engine.cache.get(batch_id).decode_inputs()


def plain_forward(engine: Engine, inputs: ForwardInputs) -> torch.Tensor:
    return engine.model.forward(inputs.input_ids, inputs.positions, engine.runner.kv_cache, inputs.meta)


def runner_for(engine: Engine, **kwargs: bool) -> DecodeGraphRunner:
    return DecodeGraphRunner(engine.model, BUCKETS, MAX_BLOCKS, BLOCK, **kwargs)


@pytest.mark.parametrize("size", [1, 3, 4, 6, 9])
def test_padded_forward_gives_the_real_rows_the_unpadded_logits(engine: Engine, size: int) -> None:
    inputs = decode_inputs(engine, size, batch_id=100 + size)
    try:
        expected = plain_forward(engine, inputs)
        runner = runner_for(engine, pad_eagerly=True)
        assert runner.takes(inputs, engine.runner.kv_cache) == (size <= max(BUCKETS))
        got = runner.forward(inputs, engine.runner.kv_cache)
        assert got.shape == expected.shape == (size, engine.model.vocab_size)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    finally:
        engine.clear(None)


def test_a_smaller_step_leaves_no_trace_of_the_larger_one(engine: Engine) -> None:
    runner = runner_for(engine)
    wide = decode_inputs(engine, 7, batch_id=1)
    narrow = decode_inputs(engine, 2, batch_id=2, first_block=100)
    try:
        assert wide.meta.block_tables.shape[1] > narrow.meta.block_tables.shape[1]
        runner.forward(wide, engine.runner.kv_cache)
        got = runner.forward(narrow, engine.runner.kv_cache)
        torch.testing.assert_close(got, plain_forward(engine, narrow), rtol=1e-5, atol=1e-5)
    finally:
        engine.clear(None)
    b, width = runner._buffers, narrow.meta.block_tables.shape[1]
    assert b.input_ids[2:].eq(0).all() and b.positions[2:].eq(0).all()
    assert b.slot_mapping[2:].eq(SCRATCH_SLOT).all() and b.seqlens_k[2:].eq(1).all()
    assert b.block_tables[2:].eq(0).all() and b.block_tables[:2, width:].eq(0).all()
    torch.testing.assert_close(b.block_tables[:2, :width], narrow.meta.block_tables)
    assert b.cu_seqlens_q.tolist() == list(range(max(BUCKETS) + 1))


def test_the_runner_takes_only_decode_steps_that_fit(engine: Engine) -> None:
    batch = batch_of(request(0, [5, 6, 7], max_new=2, block_size=BLOCK, blocks=[1]), batch_id=3)
    engine.prefill(pb.PrefillRequest(batch=batch))
    try:
        cached = engine.cache.get(3)
        assert not runner_for(engine, pad_eagerly=True).takes(cached.prefill_inputs(), engine.runner.kv_cache)
        decode = cached.decode_inputs()
        assert runner_for(engine, pad_eagerly=True).takes(decode, engine.runner.kv_cache)
        # Without graphs (none on CPU), the engine never routes a step through the runner.
        assert not runner_for(engine).takes(decode, engine.runner.kv_cache)
    finally:
        engine.clear(None)


def test_wider_block_tables_than_the_buffers_run_unpadded(engine: Engine) -> None:
    inputs = decode_inputs(engine, 5, batch_id=4)
    try:
        narrow = DecodeGraphRunner(engine.model, BUCKETS, 1, BLOCK, pad_eagerly=True)
        assert not narrow.takes(inputs, engine.runner.kv_cache)
        got = narrow.forward(inputs, engine.runner.kv_cache)
        torch.testing.assert_close(got, plain_forward(engine, inputs), rtol=1e-5, atol=1e-5)
    finally:
        engine.clear(None)


def test_the_engine_decodes_through_the_runner_with_the_same_tokens(engine: Engine) -> None:
    texts = [[5, 9, 14], [22, 7], [40, 41, 42, 43, 44, 45, 46], [8], [100, 3, 77, 12]]

    def generate(runner: DecodeGraphRunner | None) -> Run:
        engine.runner.decode_graphs = runner
        reqs = [
            request(i, t, max_new=6, block_size=BLOCK, ignore_eos=True, **MIXED[i])
            for i, t in enumerate(texts)
        ]
        run = Run(engine)
        first = run.prefill(batch_of(*reqs[:3], batch_id=10))
        assert first is not None
        merged = run.prefill(batch_of(*reqs[3:], batch_id=11), cached=run.decode(first))
        run.finish(merged)
        return run

    try:
        plain = generate(None)
        padded = generate(runner_for(engine, pad_eagerly=True))
    finally:
        engine.runner.decode_graphs = None
    assert padded.tokens == plain.tokens
    for rid in plain.logprobs:
        torch.testing.assert_close(padded.logprobs[rid], plain.logprobs[rid], rtol=1e-4, atol=1e-4)


def test_warmup_says_why_graphs_are_off(engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    cpu = engine.model.device.type == "cpu"
    # A CPU's counterpart of CUDA graphs is compiled steps, which --cpu-graphs asks for.
    reason = (
        "--cpu-graphs not set"
        if cpu
        else "the reference attention backend's shapes follow the context length"
    )
    caps = engine.runner.dist.caps
    assert (graphs_off_reason(engine.settings, engine.model, caps) or "").startswith(reason)
    off = ShardSettings(model_path=engine.settings.model_path, cuda_graphs=())
    assert graphs_off_reason(off, engine.model, caps) == ("--cpu-graphs not set" if cpu
                                                          else "--cuda-graphs 0")
    with caplog.at_level(logging.INFO, logger="pytgi_shard.engine.warmup"):
        engine.warmup(pb.WarmupRequest(max_prefill_tokens=128, max_batch_total_tokens=2048))
    what = "compiled decode steps" if cpu else "CUDA graphs"
    assert f"{what} off: {reason}" in caplog.text
    assert engine.runner.decode_graphs is None


# --- capture and replay on a GPU -------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_replayed_graphs_match_the_eager_forward(tiny_model: Callable[..., Path]) -> None:
    # The Triton backend is the one production captures: required whenever it exists.
    attention = "triton" if "triton" in BACKENDS else "reference"
    settings = ShardSettings(
        model_path=tiny_model("llama"), block_size=BLOCK, dtype="float32",
        attention=attention, cuda_graphs=BUCKETS,
    )  # fmt: skip
    gpu = load_engine(settings)
    warm = pb.WarmupRequest(
        max_prefill_tokens=128, max_total_tokens=MAX_BLOCKS * BLOCK, max_batch_total_tokens=2048
    )
    gpu.warmup(warm)
    if attention == "reference":
        assert gpu.runner.decode_graphs is None
        gpu.runner.decode_graphs = runner_for(gpu)
        gpu.runner.decode_graphs.capture(gpu.runner.kv_cache)
    runner = gpu.runner.decode_graphs
    assert runner is not None and runner.captured == BUCKETS
    for size in (1, 3, 8, 9):
        inputs = decode_inputs(gpu, size, batch_id=200 + size)
        expected = plain_forward(gpu, inputs)
        assert runner.takes(inputs, gpu.runner.kv_cache) == (size <= 8)
        got = runner.forward(inputs, gpu.runner.kv_cache)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        gpu.clear(None)
    # Through the engine: the same tokens with and without graphs.
    prompt = [5, 9, 14, 30, 2]
    reqs = [request(i, prompt[: 2 + i], max_new=5, block_size=BLOCK, ignore_eos=True)
            for i in range(3)]  # fmt: skip
    with_graphs = Run(gpu)
    with_graphs.finish(with_graphs.prefill(batch_of(*reqs, batch_id=300)))
    gpu.runner.decode_graphs = None
    without = Run(gpu)
    without.finish(without.prefill(batch_of(*reqs, batch_id=301)))
    assert with_graphs.tokens == without.tokens
    if attention == "triton":
        # A second Warmup sizes a new cache and captures again over it.
        gpu.warmup(warm)
        assert gpu.runner.decode_graphs is not None and gpu.runner.decode_graphs is not runner
        assert gpu.runner.decode_graphs.takes(decode_inputs(gpu, 3, batch_id=400), gpu.runner.kv_cache)
        gpu.clear(None)


def test_graphs_off_for_a_weight_that_synchronises() -> None:
    """LLM.int8 finds its outlier columns on the host: a model holding one decodes without
    graphs, even on a GPU with a capturable backend (its device is only read, never used)."""
    pytest.importorskip("bitsandbytes")
    from torch import nn

    from pytgi_shard.quantization.bitsandbytes_weight import BnbInt8Weight
    from pytgi_shard.quantization.int8_weight_only import Int8WeightOnly

    class OnGpu(nn.Module):
        device = torch.device("cuda")
        graph_capturable = True
        model_type = "llama"

        def __init__(self, weight: nn.Module) -> None:
            super().__init__()
            self.proj = weight

    settings = ShardSettings(model_path=Path("."), attention="triton")
    weight = torch.randn(16, 32)
    int8 = OnGpu(BnbInt8Weight.from_float(weight))
    gpu = resolve_capabilities("cuda", triton_installed=True)
    assert graphs_off_reason(settings, int8, gpu) == (  # type: ignore[arg-type]
        "BnbInt8Weight synchronises with the host in its matmul"
    )
    assert graphs_off_reason(settings, OnGpu(Int8WeightOnly.from_float(weight)), gpu) is None  # type: ignore[arg-type]

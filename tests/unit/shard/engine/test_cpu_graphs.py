"""CPU decode graphs (--cpu-graphs, shard/engine/cpu_graphs.py): each bucket's decode forward
traced and compiled at Warmup, decoding exactly as the eager engine does, its KV writes landing
in the live cache; and refused, with the reason, where a trace would freeze a host read or the
model cannot be traced."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from pytgi_launcher.cli import parse_settings
from pytgi_launcher.commands import shard_argv
from pytgi_proto import generate_pb2 as pb
from pytgi_shard.attention.kv_cache import KVCache
from pytgi_shard.engine.cpu_graphs import (
    FreeSize,
    FreeSizeGuarded,
    NotCompilable,
    compile_step,
    trace,
)
from pytgi_shard.engine.decode_graphs import DecodeGraphRunner
from pytgi_shard.engine.engine import Engine
from pytgi_shard.engine.graphs_off import graphs_off_reason
from pytgi_shard.engine.step_inputs import ForwardInputs
from pytgi_shard.service.startup import load_engine
from pytgi_shard.settings import ShardSettings
from tests.unit.shard.engine.test_batch import batch_of, request
from tests.unit.shard.engine.test_engine import MIXED, Run
from tests.unit.shard.service.test_cli import parse

BLOCK = 4
BUCKETS = (2,)
WARMUP = pb.WarmupRequest(max_prefill_tokens=128, max_batch_total_tokens=2048, max_batch_size=8)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")


class Lines(logging.Handler):
    """The warmup module's log lines (a module fixture cannot use caplog)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


WARMUP_LOG = Lines()


@pytest.fixture(scope="module")
def engines(tiny_model: Callable[..., Path]) -> Iterator[tuple[Engine, Engine]]:
    """The same tiny Llama twice: eager, and with compiled decode steps for BUCKETS."""
    path = tiny_model("llama")
    eager = load_engine(ShardSettings(model_path=path, block_size=BLOCK))
    compiled = load_engine(ShardSettings(model_path=path, block_size=BLOCK, cpu_graphs=BUCKETS))
    loggers = [logging.getLogger(f"pytgi_shard.engine.{name}")
               for name in ("warmup", "background_compile")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(WARMUP_LOG)
        logger.setLevel(logging.INFO)
    try:
        for engine in (eager, compiled):
            engine.warmup(WARMUP)
        graphs = compiled.runner.decode_graphs
        # Warmup returned before the steps were compiled: they are made on a thread.
        assert graphs is not None and graphs.compiling is not None
        graphs.compiling.join(timeout=900)
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(WARMUP_LOG)
            logger.setLevel(level)
    yield eager, compiled
    for engine in (eager, compiled):
        engine.clear(None)


def generate(engine: Engine, texts: list[list[int]], max_new: int = 8) -> Run:
    """Prefills the first two prompts, decodes a step, joins the rest, decodes to the end."""
    reqs = [
        request(i, t, max_new=max_new, block_size=BLOCK, ignore_eos=True, **MIXED[i % len(MIXED)])
        for i, t in enumerate(texts)
    ]
    run = Run(engine)
    first = run.prefill(batch_of(*reqs[:2], batch_id=10))
    assert first is not None
    merged = run.prefill(batch_of(*reqs[2:], batch_id=11), cached=run.decode(first))
    run.finish(merged)
    return run


def test_warmup_compiles_every_bucket(engines: tuple[Engine, Engine]) -> None:
    eager, compiled = engines
    assert eager.runner.decode_graphs is None
    graphs = compiled.runner.decode_graphs
    assert graphs is not None and graphs.captured == BUCKETS


def test_compiled_steps_decode_the_eager_engine_s_tokens(engines: tuple[Engine, Engine]) -> None:
    # Five requests: decode steps of 2 rows (bucket 2) then 5 (above the largest bucket:
    # eager), so both the compiled and the eager path run in one generation.
    texts = [[5, 9, 14], [22, 7], [40, 41, 42, 43, 44, 45, 46], [8], [100, 3, 77, 12]]
    eager, compiled = engines
    plain, fast = generate(eager, texts), generate(compiled, texts)
    assert fast.tokens == plain.tokens
    for rid in plain.logprobs:
        torch.testing.assert_close(fast.logprobs[rid], plain.logprobs[rid], rtol=1e-3, atol=1e-3)


def test_a_single_stream_decodes_through_the_compiled_step(engines: tuple[Engine, Engine]) -> None:
    # One request: every decode step is bucket 2's compiled step (one padding row), each
    # reading the K/V the previous compiled steps wrote into the live cache.
    eager, compiled = engines
    widths: list[int] = []
    graphs = compiled.runner.decode_graphs
    assert graphs is not None
    step = graphs._compiled[2]

    def counted(cache: KVCache, blocks: int) -> torch.Tensor:
        widths.append(blocks)
        return step(cache, blocks)

    graphs._compiled[2] = counted
    try:
        texts = [[7, 3, 9, 11, 2, 5]]
        reqs = [request(0, texts[0], max_new=12, block_size=BLOCK, ignore_eos=True)]
        runs = []
        for engine in (eager, compiled):
            run = Run(engine)
            run.finish(run.prefill(batch_of(*reqs, batch_id=20)))
            runs.append(run)
    finally:
        graphs._compiled[2] = step
    assert len(widths) == 11
    assert runs[1].tokens == runs[0].tokens
    # Each step attends the blocks its context covers (6 + 1 .. 6 + 11 tokens, BLOCK 4), not
    # the static context the step was traced over.
    assert widths == [-(-(6 + i) // BLOCK) for i in range(1, 12)]


def test_a_trace_that_reads_a_tensor_back_is_refused() -> None:
    cache = KVCache.allocate(1, 2, BLOCK, 1, 4, torch.float32, torch.device("cpu"))
    scale = torch.tensor([2.0])

    def reads_back(kv: KVCache, factor: torch.Tensor) -> torch.Tensor:
        # A host read: the traced graph would keep this step's value for every later call.
        return kv.keys[0].sum(dim=(1, 2, 3)) * float(factor.item())

    with pytest.raises(NotCompilable, match="reads a tensor value back"):
        trace(reads_back, cache, (scale,))


def test_a_compiled_step_writes_the_live_cache_and_reads_the_buffers_by_reference() -> None:
    cache = KVCache.allocate(1, 4, BLOCK, 1, 4, torch.float32, torch.device("cpu"))
    slots = torch.tensor([1, 6])
    values = torch.ones(2, 1, 4)
    table = torch.tensor([[3, 2, 1, 0]])

    def write(kv: KVCache, where: torch.Tensor, what: torch.Tensor,
              blocks: torch.Tensor) -> torch.Tensor:
        rows = kv.keys[0].view(-1, 1, 4)
        rows.index_copy_(0, where, what)
        # One sum per block the table lists: as many as the table is wide (the free size).
        return kv.keys[0].index_select(0, blocks[0]).sum(dim=(1, 2, 3))

    step = compile_step(write, cache, (slots, values, table), FreeSize(input=2, dim=1))
    cache.keys[0].zero_()
    slots.copy_(torch.tensor([9, 10]))
    values.fill_(3.0)
    out = step(cache, (slots, values, table), None)
    assert out.tolist() == [0.0, 24.0, 0.0, 0.0]
    assert cache.keys[0].view(-1, 4)[9].tolist() == [3.0] * 4
    # The same compiled step over the table's first blocks only, the narrowest raised to 2.
    assert step(cache, (slots, values, table), 3).tolist() == [0.0, 24.0, 0.0]
    assert step(cache, (slots, values, table), 1).tolist() == [0.0, 24.0]


def test_a_trace_whose_code_depends_on_the_free_size_says_so() -> None:
    cache = KVCache.allocate(1, 4, BLOCK, 1, 4, torch.float32, torch.device("cpu"))
    table = torch.tensor([[3, 2, 1, 0]])

    def branches(kv: KVCache, blocks: torch.Tensor) -> torch.Tensor:
        # A path chosen by the width: one compiled step could not serve a narrower table.
        factor = 2.0 if blocks.shape[1] > 3 else 1.0
        return kv.keys[0].index_select(0, blocks[0]).sum(dim=(1, 2, 3)) * factor

    with pytest.raises(FreeSizeGuarded, match="depends on it"):
        trace(branches, cache, (table,), FreeSize(input=0, dim=1))
    # Without a free size the same trace is one static graph.
    assert trace(branches, cache, (table,)).graph is not None


def test_compiled_steps_are_off_with_the_reason(engines: tuple[Engine, Engine]) -> None:
    eager, compiled = engines
    caps, model = eager.runner.dist.caps, eager.model
    path = eager.settings.model_path
    assert graphs_off_reason(eager.settings, model, caps) == "--cpu-graphs not set"
    on = ShardSettings(model_path=path, cpu_graphs=(1,))
    assert graphs_off_reason(on, model, caps) is None
    assert "one rank" in (graphs_off_reason(on, model, caps, world_size=2) or "")
    triton = ShardSettings(model_path=path, cpu_graphs=(1,), attention="triton")
    assert "interpreter" in (graphs_off_reason(triton, model, caps) or "")


def test_warmup_logs_the_compiled_sizes_or_why_not(engines: tuple[Engine, Engine]) -> None:
    assert "compiled decode steps off: --cpu-graphs not set" in WARMUP_LOG.lines
    lines = WARMUP_LOG.lines
    assert any(line.startswith("compiling decode steps for batch sizes [2]") for line in lines)
    assert any(line.startswith("compiled decode step for batch size 2 in") for line in lines)
    assert any(line.startswith("compiled decode steps: batch sizes [2]") for line in lines)


def test_the_shard_and_launcher_take_cpu_graphs() -> None:
    assert parse("--cpu-graphs", "1,8,4").cpu_graphs == (1, 4, 8)
    assert parse().cpu_graphs == ()
    with pytest.raises(ValueError, match="--cpu-graphs takes a comma list"):
        parse("--cpu-graphs", "x")


def test_the_launcher_passes_cpu_graphs_to_every_shard(capsys: pytest.CaptureFixture[str]) -> None:
    model = Path("/m")
    assert "--cpu-graphs" not in shard_argv(parse_settings([], {}), model, 0, 1, "float32")
    argv = shard_argv(parse_settings(["--cpu-graphs", "1,4"], {}), model, 0, 1, "float32")
    assert argv[argv.index("--cpu-graphs") + 1] == "1,4"
    with pytest.raises(SystemExit):
        parse_settings(["--cpu-graphs", "1;4"], {})
    assert "--cpu-graphs takes a comma list" in capsys.readouterr().err


def test_until_a_bucket_is_compiled_its_steps_run_eagerly(engines: tuple[Engine, Engine]) -> None:
    eager, _ = engines
    kv = eager.runner.kv_cache
    runner = DecodeGraphRunner(eager.model, BUCKETS, 8, BLOCK)
    inputs = decode_inputs(eager, 1)
    runner.expect_compiled(kv)
    assert runner.expects(kv) and not runner.takes(inputs, kv)
    runner.add_compiled(2, lambda cache, blocks: torch.zeros(1))
    assert runner.takes(inputs, kv)
    # A later Warmup lets the cache go: what the thread compiles for it is no longer wanted.
    runner.release()
    assert not runner.expects(kv) and not runner.takes(inputs, kv)
    eager.clear(None)


def decode_inputs(engine: Engine, batch_id: int) -> ForwardInputs:
    """The decode step's inputs of one prefilled request."""
    req = request(0, [4, 8, 15], max_new=3, block_size=BLOCK, ignore_eos=True, blocks=[1])
    engine.prefill(pb.PrefillRequest(batch=batch_of(req, batch_id=batch_id)))
    return engine.cache.get(batch_id).decode_inputs()


def test_a_model_whose_query_is_a_view_of_its_fused_projection_compiles_exactly(
    tiny_model: Callable[..., Path],
) -> None:
    # BLOOM's queries are a strided view into its fused QKV projection, and its ALiBi bias is
    # added to the scores: the compiled step (fused attention over a free context width) must
    # give the eager forward's logits call after call, eager forwards in between (a query
    # stored through the view's strides once read memory the compiler had laid out otherwise).
    engine = load_engine(ShardSettings(model_path=tiny_model("bloom"), block_size=BLOCK))
    engine.warmup(WARMUP)
    kv = engine.runner.kv_cache
    runner = DecodeGraphRunner(engine.model, BUCKETS, 8, BLOCK)
    step = runner.compile_bucket(2, kv)
    b = runner._buffers
    b.input_ids[:2].copy_(torch.tensor([5, 9]))
    b.positions[:2].copy_(torch.tensor([6, 2]))
    b.seqlens_k[:2].copy_(torch.tensor([7, 3], dtype=torch.int32))
    b.block_tables[:2, :2].copy_(torch.tensor([[1, 2], [3, 0]], dtype=torch.int32))
    b.slot_mapping[:2].copy_(torch.tensor([2 * BLOCK + 2, 3 * BLOCK + 2]))  # positions 6, 2
    for _ in range(4):
        with torch.inference_mode():
            expected = runner._run(2, kv, 2 * BLOCK)
            got = step(kv, 2)
        torch.testing.assert_close(got, expected, atol=1e-3, rtol=0)
    engine.clear(None)

"""Speculation through the decode CUDA graphs (shard/engine/verify_graphs.py): a verification
step replays the decode graph of its token count as one row per token, and the draft model's
forwards replay its own graphs.

On CPU the graph runner's eager padding (pad_eagerly) runs the same buffers and the same
per-token expansion a replay reads: a verification step through it gives the varlen forward's
logits, and an engine decoding through it serves the greedy tokens (and logprobs) of the engine
without speculation, for n-gram drafts and for a draft model. The capture itself needs a GPU
(the CUDA test at the end, run by bench/gpu.sh's tests stage).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.attention.backend import BACKENDS
from pytgi_shard.attention.kv_cache import KVCache
from pytgi_shard.attention.metadata import AttentionMetadata
from pytgi_shard.engine.decode_graphs import DecodeGraphRunner, token_rows
from pytgi_shard.engine.draft_model import DraftModel
from pytgi_shard.engine.drafting import STEP_TOKENS, Drafts
from pytgi_shard.engine.engine import Engine
from pytgi_shard.engine.hidden_drafter import HiddenStateDrafter
from pytgi_shard.engine.step_inputs import ForwardInputs
from pytgi_shard.engine.verification import verify_inputs
from pytgi_shard.engine.verify_graphs import (
    draft_buckets,
    most_verified_tokens,
    verification_buckets,
)
from pytgi_shard.models.model import Model
from pytgi_shard.service.startup import load_engine
from pytgi_shard.settings import DEFAULT_CUDA_GRAPHS, ShardSettings
from tests.lora_adapters import write_adapter
from tests.unit.shard.engine.speculator_cases import (
    BLOCK,
    SPECULATE,
    assert_same,
    build,
    requests,
    serve,
    watch_newest_token_drafts,
)
from tests.unit.shard.engine.test_batch import batch_of, request
from tests.unit.shard.engine.test_medusa import write_heads
from tests.unit.shard.engine.test_speculation import greedy
from tests.unit.shard.router_steps import prompt_of

BUCKETS = (1, 2, 4, 8, 16, 32)
MAX_BLOCKS = 64


# --- the pure parts --------------------------------------------------------------------------


def test_each_token_of_a_varlen_step_attends_to_its_own_position() -> None:
    # Three requests: 3 new tokens after 5 cached, 1 after 9, 2 after 0.
    meta = AttentionMetadata.build([3, 1, 2], [5, 9, 0], [[1, 2], [3, 4, 5], [6]], 4,
                                   torch.device("cpu"))
    rows, seqlens = token_rows(meta, 6)
    assert rows.tolist() == [0, 0, 0, 1, 2, 2]
    assert seqlens.tolist() == [6, 7, 8, 10, 1, 2]
    assert seqlens.dtype == torch.int32


def test_verification_adds_the_buckets_a_low_max_batch_size_cut_off() -> None:
    most = most_verified_tokens(4, drafting_batch=2)
    assert most == 10
    assert most_verified_tokens(0) == 0
    assert most_verified_tokens(16, drafting_batch=4) == STEP_TOKENS
    # --max-batch-size 4 collapsed the decode buckets to (1, 2, 4): 8 and 16 come back.
    assert verification_buckets((1, 2, 4), DEFAULT_CUDA_GRAPHS, most) == (1, 2, 4, 8, 16)
    assert verification_buckets((1, 2, 4, 8, 16, 32), DEFAULT_CUDA_GRAPHS, most) == (
        1, 2, 4, 8, 16, 32)
    # Graphs off stay off; no --speculate adds nothing; sizes that never hold it add all.
    assert verification_buckets((), DEFAULT_CUDA_GRAPHS, most) == ()
    assert verification_buckets((1, 2), DEFAULT_CUDA_GRAPHS, 0) == (1, 2)
    assert verification_buckets((1,), (1, 2, 4), most) == (1, 2, 4)


def test_the_draft_model_captures_only_the_buckets_its_forwards_reach() -> None:
    assert draft_buckets(DEFAULT_CUDA_GRAPHS, 10) == (1, 2, 4, 8, 16)
    assert draft_buckets(DEFAULT_CUDA_GRAPHS, 32) == (1, 2, 4, 8, 16, 32)
    assert draft_buckets((1, 2, 4), 10) == (1, 2, 4)


# --- the padded path on CPU ------------------------------------------------------------------


class CountingRunner(DecodeGraphRunner):
    """The runner with its eager padding, recording each step's (tokens, requests)."""

    def __init__(self, model: Model) -> None:
        super().__init__(model, BUCKETS, MAX_BLOCKS, BLOCK, pad_eagerly=True)
        self.steps: list[tuple[int, int]] = []

    def forward(self, inputs: ForwardInputs, kv_cache: object) -> torch.Tensor:
        self.steps.append((int(inputs.input_ids.shape[0]), inputs.meta.batch_size))
        return super().forward(inputs, kv_cache)  # type: ignore[arg-type]

    @property
    def several_per_row(self) -> int:
        """Steps that carried more tokens than requests (verifications, catch-ups)."""
        return sum(tokens > rows for tokens, rows in self.steps)


@pytest.fixture(scope="module")
def engines(tiny_model: Callable[..., Path]) -> Iterator[dict[str, Engine]]:
    target = tiny_model("llama")
    yield {
        "plain": build(target),
        "ngram": build(target, SPECULATE),
        "draft": build(target, SPECULATE, target),
        "other": build(target, SPECULATE, tiny_model("qwen2")),
    }


def test_a_verification_step_through_the_padded_buffers_gives_the_varlen_logits(
    engines: dict[str, Engine],
) -> None:
    engine = engines["ngram"]
    prompts = [prompt_of(9, 1), prompt_of(14, 2), prompt_of(5, 3)]
    reqs, first = [], 1
    for i, prompt in enumerate(prompts):
        # Blocks for the prompt, the step's token and up to 4 drafts.
        blocks = list(range(first, first + -(-(len(prompt) + 6) // BLOCK)))
        reqs.append(request(i, prompt, max_new=8, block_size=BLOCK, blocks=blocks))
        first += len(blocks)
    engine.prefill(pb.PrefillRequest(batch=batch_of(*reqs, batch_id=7)))
    batch = engine.cache.get(7)
    try:
        inputs = verify_inputs(batch, Drafts([0, 2], [[11, 12, 13], [40]]))
        assert inputs.input_ids.shape[0] == 7 and inputs.meta.max_seqlen_q == 4
        kv = engine.runner.kv_cache
        expected = engine.model.forward(inputs.input_ids, inputs.positions, kv, inputs.meta)
        runner = CountingRunner(engine.model)
        assert runner.takes(inputs, kv)
        got = runner.forward(inputs, kv)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        # The 8-row bucket's last row is padding: it read nothing of the requests' blocks.
        assert runner._buffers.block_tables[7].eq(0).all()
    finally:
        engine.clear(None)


def graphed(engine: Engine) -> tuple[CountingRunner, CountingRunner | None]:
    """The engine's target (and draft model) decoding through padded graph runners."""
    target = CountingRunner(engine.model)
    engine.runner.decode_graphs = target
    draft = engine.runner.draft
    if draft is None:
        return target, None
    draft.graphs = CountingRunner(draft.model)
    return target, draft.graphs  # type: ignore[return-value]


def ungraphed(engine: Engine) -> None:
    engine.runner.decode_graphs = None
    if engine.runner.draft is not None:
        engine.runner.draft.graphs = None


@pytest.mark.parametrize("drafter", ["ngram", "draft", "other"])
def test_served_greedy_tokens_through_the_graph_path_equal_those_without_speculation(
    engines: dict[str, Engine], drafter: str
) -> None:
    expected = serve(engines["plain"], requests())
    eager = serve(engines[drafter], requests())
    engine = engines[drafter]
    target, draft = graphed(engine)
    try:
        got = serve(engine, requests())
    finally:
        ungraphed(engine)
    assert_same(got.run, expected.run)
    assert (got.drafted, got.kept) == (eager.drafted, eager.kept)
    assert got.drafted > 0
    if drafter != "other":
        # The tiny Llama repeats itself, and agrees with itself as a draft: drafts are kept.
        # (Another family's random weights, "other", keep none: their misses verify too.)
        assert got.kept > 0
    # Verification steps went through the target's buffers as one row per token.
    assert target.several_per_row > 0
    if draft is not None:
        # The draft's one-token forwards and its short catch-ups went through its own.
        assert any(tokens == rows for tokens, rows in draft.steps)
        assert draft.several_per_row > 0


def test_verification_through_the_buffers_keeps_each_token_s_lora_adapter(
    engines: dict[str, Engine], tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    """A verification step's tokens carry their row's adapter slot into the buffers (one row
    per token): rows of two adapters and the base model, drafting together, serve the tokens of
    the same adapters without speculation."""
    base = tiny_model("llama")
    spec = ",".join(f"{name}={write_adapter(tmp_path / name, base, rank=4, alpha=8, seed=seed)}"
                    for name, seed in (("alpha", 1), ("beta", 2)))
    plain, speculating = build(base, lora_adapters=spec), build(base, SPECULATE,
                                                                 lora_adapters=spec)
    reqs = [greedy(i, prompt_of(12, 4) * 2, 20, adapter_index=i) for i in range(3)]
    expected = serve(plain, reqs)
    target, _ = graphed(speculating)
    try:
        got = serve(speculating, reqs)
    finally:
        ungraphed(speculating)
    assert_same(got.run, expected.run)
    assert got.kept > 0 and target.several_per_row > 0
    assert len({tuple(t) for t in expected.run.tokens.values()}) == 3  # the adapters matter


def test_the_overlap_scheduler_looks_ahead_through_the_graphs_beside_verification(
    engines: dict[str, Engine], tiny_model: Callable[..., Path]
) -> None:
    """README: steps that carry drafts replay the graphs without the overlap look-ahead, and
    batches too large to draft keep both. With overlap on, a batch above the drafting cap looks
    ahead through the runner (one token per request), and once requests finish the last one
    drafts through it (several tokens per request); the tokens are the plain engine's."""
    engine = load_engine(ShardSettings(
        model_path=tiny_model("llama"), block_size=BLOCK, overlap=True, attention="reference",
        speculate=SPECULATE,
    ))
    engine.warmup(pb.WarmupRequest(max_prefill_tokens=128, max_batch_total_tokens=4096))
    engine.drafting_batch = 1
    reqs = [greedy(i, prompt_of(10, 3) * 3, 8 + 8 * i) for i in range(3)]
    expected = serve(engines["plain"], reqs)
    target, _ = graphed(engine)
    computed_ahead = []
    take = engine.runner.lookaheads.take

    def taking(ids: list[int]) -> object:
        found = take(ids)
        computed_ahead.append(found is not None)
        return found

    engine.runner.lookaheads.take = taking  # type: ignore[method-assign]
    try:
        got = serve(engine, reqs)
    finally:
        ungraphed(engine)
    assert got.run.tokens == expected.run.tokens
    assert any(computed_ahead), "the 3-request batch looked ahead"
    assert got.kept > 0 and target.several_per_row > 0, "the last request drafted"
    assert any(tokens == rows > 1 for tokens, rows in target.steps)


def test_speculator_heads_read_the_hidden_state_the_graph_path_hands_over(
    engines: dict[str, Engine], tiny_model: Callable[..., Path], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Medusa heads that are the identity before the target's LM head propose, from the
    hidden state at a row's position L - 2, the row's newest token; through the graph runner
    (no hook runs in a replay) the runner hands the tap each forward's hidden states and the
    buffers' slots, and every proposal is still the newest token."""
    engine = build(tiny_model("llama"), SPECULATE, write_heads(tmp_path / "identity", False,
                                                               scale=0.0))
    assert isinstance(engine.runner.hidden_tap, HiddenStateDrafter)
    seen = watch_newest_token_drafts(engine, monkeypatch)
    target, _ = graphed(engine)
    target.tap = engine.runner.hidden_tap
    reqs = [greedy(0, prompt_of(12, 7) * 2, 20), greedy(1, prompt_of(8, 8), 16)]
    expected = serve(engines["plain"], reqs, chunk=5)
    try:
        got = serve(engine, reqs, chunk=5)
    finally:
        ungraphed(engine)
    assert_same(got.run, expected.run)
    assert len(seen) >= 4 and all(seen)
    assert target.several_per_row > 0 and any(t == r for t, r in target.steps)


def test_a_new_warmup_lets_the_draft_model_s_graphs_go_with_the_target_s(
    engines: dict[str, Engine],
) -> None:
    """The draft's graphs hold its old cache (and their pool): Warmup's release_graphs drops
    them with the target's, and on a CPU none are captured again."""
    engine = engines["draft"]
    draft = engine.runner.draft
    assert isinstance(draft, DraftModel)
    graphed(engine)
    engine.warmup(pb.WarmupRequest(max_prefill_tokens=128, max_batch_total_tokens=4096))
    assert engine.runner.decode_graphs is None and draft.graphs is None


# --- capture and replay on a GPU -------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("speculator", ["ngram", "draft", "medusa"])
def test_captured_graphs_verify_with_the_tokens_of_the_eager_engine(
    tiny_model: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    speculator: str,
) -> None:
    """Warmup captures the target's graphs (and the draft model's); a speculating run replays
    verification steps from them and serves what the same engine serves without graphs;
    identity Medusa heads, fed by the replays' hidden states, propose each newest token."""
    if "triton" not in BACKENDS:
        pytest.skip("the Triton backend is the one production captures")
    target = tiny_model("llama")
    draft = {"ngram": None, "draft": target,
             "medusa": write_heads(tmp_path / "identity", False, scale=0.0)}[speculator]
    fields = {"attention": "triton", "dtype": "float32", "cuda_graphs": BUCKETS}
    eager = build(target, SPECULATE, draft, **{**fields, "cuda_graphs": ()})
    engine = build(target, SPECULATE, draft, **fields)
    runner = engine.runner.decode_graphs
    assert runner is not None and runner.captured == BUCKETS
    if speculator == "draft":
        assert engine.runner.draft is not None and engine.runner.draft.graphs is not None
        assert engine.runner.draft.graphs.captured
    replayed: list[bool] = []
    forward = runner.forward

    def watched(inputs: ForwardInputs, kv_cache: KVCache) -> torch.Tensor:
        replayed.append(int(inputs.input_ids.shape[0]) > inputs.meta.batch_size)
        return forward(inputs, kv_cache)

    monkeypatch.setattr(runner, "forward", watched)
    seen = watch_newest_token_drafts(engine, monkeypatch) if speculator == "medusa" else None
    expected = serve(eager, requests(sampling=False))
    got = serve(engine, requests(sampling=False))
    assert got.run.tokens == expected.run.tokens
    assert any(replayed), "a verification step replayed a decode graph"
    if seen is not None:
        assert len(seen) >= 4 and all(seen)
    else:
        assert got.kept > 0

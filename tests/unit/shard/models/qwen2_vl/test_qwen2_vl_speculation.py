"""Requests with images draft (--speculate): a Qwen2-VL request's verification feeds its drafts at
M-RoPE positions (sequence index + the request's rope delta, as decode does), so its greedy
tokens and logprobs with speculation equal those without, eagerly and through the decode graphs'
padded buffers (one row per token), beside a text-only request in the same batch: with n-gram
proposals (all rejected by the random tiny model, whose output never returns to its prompt's
repeated text) and with proposals that verification keeps. A vision-language draft model is
refused."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.engine.batch import Batch
from pytgi_shard.engine.decode_graphs import DecodeGraphRunner
from pytgi_shard.engine.drafter import NgramDrafter
from pytgi_shard.engine.drafting import Drafts
from pytgi_shard.engine.engine import Engine
from pytgi_shard.service.startup import StartupRefused, load_engine
from pytgi_shard.settings import ShardSettings
from tests.unit.shard.engine.speculator_cases import Served, assert_same
from tests.unit.shard.models.qwen2_vl.vlm_cases import picture, process, prompt_with, wire_images
from tests.unit.shard.router_steps import BLOCK, request
from tests.vision_models import write_qwen2_vl_model

SPECULATE = 4
MAX_NEW = 48


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen2_vl_model(tmp_path_factory.mktemp("qwen2_vl"))


def build(model: Path, speculate: int) -> Engine:
    engine = load_engine(ShardSettings(model_path=model, block_size=BLOCK, overlap=False,
                                       attention="reference", speculate=speculate))
    engine.warmup(pb.WarmupRequest(max_prefill_tokens=256, max_batch_total_tokens=8192))
    engine.drafting_batch = 64
    return engine


@pytest.fixture(scope="module")
def engines(model_dir: Path) -> Iterator[tuple[Engine, Engine]]:
    yield build(model_dir, 0), build(model_dir, SPECULATE)


def requests(model_dir: Path) -> list[pb.Request]:
    """An image then text said three times; two images with text between and after, repeated;
    a text-only request."""
    words = [13, 14, 15, 16, 17, 18]
    one = prompt_with(model_dir, [[10, 11], process(model_dir, picture((60, 40), 1)),
                                  words * 3])
    two = prompt_with(model_dir, [[20, 21], process(model_dir, picture((60, 40), 2)), [22, 23],
                                  process(model_dir, picture((40, 90), 3)), [24, 25, 26] * 4])
    text = prompt_with(model_dir, [[40, 41, 42, 43] * 3])
    return [
        request(i + 1, p.ids, max_new=MAX_NEW, blocks=[], images=wire_images(p))
        for i, p in enumerate((one, two, text))
    ]


def serve(engine: Engine, reqs: list[pb.Request]) -> Served:
    served = Served(engine)
    for r in reqs:
        served.prefill(r.id, r, 0, len(r.input_ids))
    served.finish()
    return served


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-buffers"])
def test_image_requests_draft_with_the_tokens_of_a_run_without_speculation(
    engines: tuple[Engine, Engine], model_dir: Path, graphs: bool
) -> None:
    plain, speculating = engines
    reqs = requests(model_dir)
    expected = serve(plain, reqs)
    runner = DecodeGraphRunner(speculating.model, (1, 2, 4, 8, 16, 32), 32, BLOCK,
                               pad_eagerly=True) if graphs else None
    speculating.runner.decode_graphs = runner
    try:
        got = serve(speculating, reqs)
    finally:
        speculating.runner.decode_graphs = None
    assert_same(got.run, expected.run)
    # n-gram proposals were made (the generated text meets earlier pairs of tokens) and
    # verified; all rejected by this random model, so each step emitted one token.
    assert got.drafted > 0
    assert all(len(tokens) == MAX_NEW for tokens in got.run.tokens.values())


class Scripted:
    """A drafter proposing each row's true continuation (from a run without speculation), its
    last draft made wrong on every other proposal: drafts are kept (all, or all but the
    last), so the verification's logits at every drafted position decide tokens. The random
    tiny Qwen2-VL never falls back into its prompt's repeated text, so n-gram proposals are
    all rejected there (the test above); this one makes verification keep them."""

    name = "scripted"

    def __init__(self, tokens: dict[int, list[int]]) -> None:
        self.tokens = tokens
        self.proposals = 0

    def propose(self, batch: Batch, asks: Sequence[tuple[int, int]]) -> Drafts | None:
        rows, drafts = [], []
        for row, k in asks:
            r = batch.requests[row]
            done = r.text.generated
            proposal = self.tokens[r.id][done : done + k]
            if not proposal:
                continue
            self.proposals += 1
            if self.proposals % 2 == 0:
                proposal[-1] = (proposal[-1] + 1) % VOCAB
            rows.append(row)
            drafts.append(proposal)
        return Drafts(rows, drafts) if rows else None


VOCAB = 300


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-buffers"])
def test_kept_drafts_of_image_requests_are_verified_at_their_m_rope_positions(
    engines: tuple[Engine, Engine], model_dir: Path, graphs: bool
) -> None:
    plain, speculating = engines
    reqs = requests(model_dir)
    expected = serve(plain, reqs)
    speculating.drafter = Scripted(expected.run.tokens)
    speculating.runner.decode_graphs = DecodeGraphRunner(
        speculating.model, (1, 2, 4, 8, 16, 32), 64, BLOCK, pad_eagerly=True) if graphs else None
    try:
        got = serve(speculating, reqs)
    finally:
        speculating.drafter = NgramDrafter()
        speculating.runner.decode_graphs = None
    assert_same(got.run, expected.run)
    kept = {rid: sum(len(g.tokens.ids) - 1 for g in gens)
            for rid, gens in got.run.generations.items()}
    # Most of each request's tokens came from kept drafts, the image requests' included.
    assert all(n >= MAX_NEW // 2 for n in kept.values()), kept


def test_a_vision_language_draft_model_is_refused_in_one_line(model_dir: Path) -> None:
    """A draft model drafts from token ids alone: a vision-language one would read its image
    tokens without their images and its text at unshifted positions."""
    with pytest.raises(StartupRefused, match="qwen2_vl is a vision-language model; a draft model"):
        load_engine(ShardSettings(model_path=model_dir, block_size=BLOCK, speculate=2,
                                  speculator_model=model_dir, attention="reference"))

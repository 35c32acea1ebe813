"""The engine's request features with images (issue 28, point 5), on Qwen2-VL (M-RoPE positions,
chunks may split an image), LLaVA-NeXT (1-D, causal: chunks split the image too), Idefics3 (an
image as ten tiles, chunks cutting tiles), PaliGemma (the whole prompt one bidirectional prefix,
so a chunk may only end at the prompt's end) and Gemma 3 (bidirectional within each image:
chunks end around it): a regex or JSON-schema grammar gives valid
output, and the same greedy tokens alone as beside other image requests mixed into their decode
steps; seeded sampling is reproducible and equal across batch compositions; a stop sequence ends
the request at the token that completes it; a request filtered out mid-decode and resumed with
its generated tokens (whole, or in chunks that cross an image or the prompt's end) continues
with the tokens and logprobs of the uninterrupted run, grammar and sampler included.

Every expectation is an independent run of the same request (alone, one prefill, blocks for its
whole life); the logits themselves are proven against transformers by each family's tests."""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import pytest
import torch
import torch.multiprocessing as mp

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.engine.engine import Engine
from pytgi_shard.output.stopping import EOS_TOKEN, STOP_SEQUENCE
from pytgi_shard.service.startup import load_engine
from pytgi_shard.settings import ShardSettings
from tests.idefics3_models import write_idefics3_model
from tests.siglip_models import write_gemma3_model, write_paligemma_model
from tests.unit.shard.engine.test_engine import Run
from tests.unit.shard.models.idefics3 import idefics3_cases as idefics
from tests.unit.shard.models.llava_next import llava_cases as llava
from tests.unit.shard.models.qwen2_vl import vlm_cases as qwen
from tests.unit.shard.models.siglip import siglip_cases as siglip
from tests.unit.shard.models.test_models import _free_port
from tests.unit.shard.router_steps import BLOCK, Router, build_engine, reference_run, request
from tests.vision_models import write_llava_next_model, write_qwen2_vl_model

TOL = 1e-4
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "boolean"}, "b": {"enum": ["x", "y", 3]}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
REGEX = "[0-9]{2}-(yes|no)"
SEEDED = pb.NextTokenChooserParameters(do_sample=True, seed=11, temperature=1.2, top_k=40)


@dataclass
class Family:
    """One VLM's engine and two image prompts (the same text, different images), with the
    chunk cuts its router may make inside a prompt (`cuts`: Qwen2-VL's through the image,
    PaliGemma's none, its whole prompt being one bidirectional span)."""

    engine: Engine
    prompts: list[tuple[list[int], list[pb.Image]]]
    cuts: list[int]
    path: Path


# Two image prompts of a checkpoint (the same text, different images) and its legal cuts.
Prompts = tuple[list[tuple[list[int], list[pb.Image]]], list[int]]


def _qwen2_vl(path: Path) -> Prompts:
    prompts = []
    for seed in (1, 2):
        p = qwen.prompt_with(path, [[10, 11, 12], qwen.process(path, qwen.picture((60, 40), seed)),
                                    [13, 14, 15, 16, 17]])
        prompts.append((p.ids, qwen.wire_images(p)))
    offset, count = prompts[0][1][0].token_offset, prompts[0][1][0].token_count
    return prompts, [offset + 2, offset + count - 1]


def _paligemma(path: Path) -> Prompts:
    prompts = []
    for seed in (1, 2):
        p = siglip.paligemma_prompt(path, "What is this?", [siglip.picture((40, 30), seed)])
        prompts.append((p.ids, siglip.wire_images(p)))
    return prompts, []


def _llava_next(path: Path) -> Prompts:
    prompts = []
    for seed in (1, 2):
        p = llava.prompt_with(path, [[10, 11, 12], llava.process(path, qwen.picture((60, 40), seed)),
                                     [13, 14, 15, 16, 17]])
        prompts.append((p.ids, llava.wire_images(p)))
    offset, count = prompts[0][1][0].token_offset, prompts[0][1][0].token_count
    return prompts, [offset + 3, offset + count - 2]


def _gemma3(path: Path) -> Prompts:
    """Gemma 3: bidirectional within each image's tokens, so chunks end only around them."""
    prompts = []
    for seed in (1, 2):
        p = siglip.gemma3_prompt(path, ["Look", siglip.picture((40, 30), seed), "what is it?"])
        prompts.append((p.ids, siglip.wire_images(p)))
    offset, count = prompts[0][1][0].token_offset, prompts[0][1][0].token_count
    return prompts, [offset - 1, offset + count]


def _idefics3(path: Path) -> Prompts:
    """Idefics3: an image is several tiles (one wire image each), causal; chunks cut tiles."""
    prompts = []
    for seed in (1, 2):
        p = idefics.idefics3_prompt(path, [idefics.picture((70, 50), seed), "What is this?"])
        prompts.append((p.ids, idefics.wire_images(p)))
    first, last = prompts[0][1][0], prompts[0][1][-1]
    return prompts, [first.token_offset + 2, last.token_offset + 1]


FAMILIES: dict[str, tuple[Callable[..., Path], Callable[[Path], Prompts]]] = {
    "qwen2_vl": (write_qwen2_vl_model, _qwen2_vl), "paligemma": (write_paligemma_model, _paligemma),
    "llava_next": (write_llava_next_model, _llava_next), "gemma3": (write_gemma3_model, _gemma3),
    "idefics3": (write_idefics3_model, _idefics3)}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    write, prompts_of = FAMILIES[request.param]
    path = write(tmp_path_factory.mktemp(request.param))
    prompts, cuts = prompts_of(path)
    return Family(build_engine(path), prompts, cuts, path)


@pytest.fixture
def fam(family: Family) -> Family:
    family.engine.clear(None)
    return family


def vlm(fam: Family, rid: int, which: int = 0, max_new: int = 8, **fields: object) -> pb.Request:
    ids, images = fam.prompts[which]
    r = request(rid, ids, max_new=max_new, blocks=[], **fields)
    r.images.extend(images)
    return r


def constrained(fam: Family, rid: int, kind: str, which: int = 0,
                params: pb.NextTokenChooserParameters | None = None) -> pb.Request:
    """A greedy (or `params`) request under a regex or JSON schema, EOS allowed."""
    p = pb.NextTokenChooserParameters()
    if params is not None:
        p.CopyFrom(params)
    if kind == "regex":
        p.grammar, p.grammar_type = REGEX, pb.GRAMMAR_TYPE_REGEX
    else:
        p.grammar, p.grammar_type = json.dumps(SCHEMA), pb.GRAMMAR_TYPE_JSON
    r = vlm(fam, rid, which, max_new=40, parameters=p)
    r.stopping_parameters.ignore_eos_token = False
    return r


def assert_valid(final: pb.GeneratedText, kind: str) -> None:
    assert final.finish_reason == EOS_TOKEN, final.text
    if kind == "regex":
        assert re.fullmatch(REGEX, final.text), final.text
    else:
        jsonschema.validate(json.loads(final.text), SCHEMA)


def as_router_sends(r: pb.Request) -> pb.Request:
    """Pixel values only with the chunks that compute some of the image's tokens (batch_wire)."""
    end = r.cache_len + r.chunk_len if r.chunk_len else len(r.input_ids) + len(r.generated_ids)
    for image in r.images:
        if not (image.token_offset < end
                and r.cache_len < image.token_offset + image.token_count):
            image.ClearField("pixel_values")
            image.ClearField("shape")
    return r


def mixed(fam: Family, reqs: list[pb.Request], engine: Engine | None = None) -> Run:
    """The batching tricks: the first request prefilled alone (in chunks through its image
    where the model allows), each next one joining the running batch's step, in chunks too."""
    router = Router(engine or fam.engine)
    batch_id = itertools.count(1).__next__
    for r in reqs:
        cuts = [0, *fam.cuts, len(r.input_ids)]
        for start, end in itertools.pairwise(cuts):
            router.prefill(batch_id(), [as_router_sends(router.chunk(r, start, end - start))])
        if router.cached is not None:
            router.decode()
    router.finish()
    return router.run


@pytest.mark.parametrize("kind", ["regex", "json"])
def test_a_constrained_image_request_is_valid_and_batching_keeps_its_tokens(
    fam: Family, kind: str
) -> None:
    alone = reference_run(fam.engine, [constrained(fam, 1, kind)])
    assert_valid(alone.finals[1], kind)
    other = reference_run(fam.engine, [constrained(fam, 2, kind, which=1)])
    fam.engine.clear(None)
    free = vlm(fam, 3, which=1, max_new=10)
    free_alone = reference_run(fam.engine, [free])
    fam.engine.clear(None)
    run = mixed(fam, [free, constrained(fam, 1, kind), constrained(fam, 2, kind, which=1)])
    assert run.tokens[1] == alone.tokens[1]
    assert run.tokens[2] == other.tokens[2]
    assert run.tokens[3] == free_alone.tokens[3]
    torch.testing.assert_close(run.logprobs[1], alone.logprobs[1], rtol=TOL, atol=TOL)
    assert_valid(run.finals[2], kind)


def test_seeded_sampling_with_images_is_reproducible_across_batches(fam: Family) -> None:
    seeded = [vlm(fam, rid, which=rid % 2, max_new=10, parameters=SEEDED) for rid in (1, 2)]
    alone = reference_run(fam.engine, seeded)
    again = reference_run(fam.engine, seeded)
    assert alone.tokens == again.tokens
    greedy = vlm(fam, 3, which=1, max_new=10)
    grammar = constrained(fam, 4, "json", params=SEEDED)
    fam.engine.clear(None)
    run = mixed(fam, [greedy, seeded[0], grammar, seeded[1]])
    for rid in (1, 2):
        assert run.tokens[rid] == alone.tokens[rid]
        assert run.finals[rid].seed == 11
        torch.testing.assert_close(run.logprobs[rid], alone.logprobs[rid], rtol=TOL, atol=TOL)
    assert_valid(run.finals[4], "json")
    # Not the greedy tokens: the seed did draw (else the equalities above would prove little).
    greedy_alone = reference_run(fam.engine, [vlm(fam, 1, which=1, max_new=10)])
    assert greedy_alone.tokens[1] != alone.tokens[1]


def _texts(run: Run, rid: int) -> list[str]:
    return [t for g in run.generations[rid] for t in g.tokens.texts]


def test_a_stop_sequence_ends_an_image_request_at_its_token(fam: Family) -> None:
    # Seeded: PaliGemma's greedy tokens repeat one <locNNNN> whose every stop string is seen early.
    free = reference_run(fam.engine, [vlm(fam, 1, max_new=16, parameters=SEEDED)])
    pieces = _texts(free, 1)
    for k in range(2, len(pieces)):
        before = "".join(pieces[:k])
        if before and pieces[k] and (stop := before[-1] + pieces[k][0]) not in before:
            break
    else:
        pytest.fail("no token to stop at: change the prompt")
    fam.engine.clear(None)
    run = mixed(fam, [vlm(fam, 2, which=1), vlm(fam, 1, max_new=16, stop=[stop],
                                                  parameters=SEEDED)])
    final = run.finals[1]
    assert final.finish_reason == STOP_SEQUENCE
    assert run.tokens[1] == free.tokens[1][: k + 1] and final.generated_tokens == k + 1
    assert final.text == fam.engine.detokenizer.decode(free.tokens[1][: k + 1],
                                                       skip_special_tokens=True)


def _preempted(fam: Family, r: pb.Request, steps: int) -> list[int]:
    """`r` prefilled beside another image request, decoded `steps` times, then filtered out of
    the batch (the router's preemption): the tokens it had."""
    other = vlm(fam, 50, which=1, max_new=20)
    run = Run(fam.engine)
    reqs = []
    for k, x in enumerate((r, other)):
        y = pb.Request()
        y.CopyFrom(x)
        total = len(x.input_ids) + x.stopping_parameters.max_new_tokens
        y.blocks[:] = list(range(1 + 30 * k, 1 + 30 * k + math.ceil(total / fam.engine.block_size)))
        reqs.append(y)
    cached = run.prefill(pb.Batch(id=1, requests=reqs, size=2))
    for _ in range(steps):
        assert cached is not None
        cached = run.decode(cached)
    assert cached is not None and r.id in cached.request_ids
    fam.engine.filter(cached.id, [other.id])
    fam.engine.clear(None)
    return run.tokens[r.id]


def resumed(fam: Family, r: pb.Request, done: list[int], chunked: bool) -> Run:
    """`r` resumed as the router does after a preemption: `done` its generated_ids, on fresh
    blocks, its prompt and `done` prefilled whole or (`chunked`) in chunks through the image
    (Qwen2-VL, LLaVA-NeXT), around it (Gemma 3), or the prompt then its generated tokens
    (PaliGemma: its bidirectional prefix must be one chunk)."""
    again = pb.Request()
    again.CopyFrom(r)
    again.generated_ids[:] = done
    router = Router(fam.engine, next_block=100)
    total = len(r.input_ids) + len(done)
    cuts = [0, *(fam.cuts or [len(r.input_ids)]), total] if chunked else [0, total]
    for step, (start, end) in enumerate(itertools.pairwise(cuts)):
        router.prefill(step + 1, [as_router_sends(router.chunk(again, start, end - start))])
    router.finish()
    return router.run


@pytest.mark.parametrize("params", ["greedy", "seeded", "json"])
@pytest.mark.parametrize("chunked", [False, True])
def test_a_preempted_image_request_resumes_with_the_same_tokens(
    fam: Family, params: str, chunked: bool
) -> None:
    if params == "json":
        r = constrained(fam, 1, "json", params=SEEDED)
    else:
        r = vlm(fam, 1, max_new=10, parameters=SEEDED if params == "seeded" else None)
    whole = reference_run(fam.engine, [r])
    fam.engine.clear(None)
    done = _preempted(fam, r, steps=2)
    assert done == whole.tokens[1][:3]
    run = resumed(fam, r, done, chunked)
    assert run.tokens[1] == whole.tokens[1][3:]
    torch.testing.assert_close(run.logprobs[1], whole.logprobs[1][3:], rtol=TOL, atol=TOL)
    final, expected = run.finals[1], whole.finals[1]
    assert (final.text, final.generated_tokens, final.finish_reason) == (
        expected.text, expected.generated_tokens, expected.finish_reason)
    if params == "json":
        assert_valid(final, "json")


@pytest.mark.parametrize("overlap", [False, True])
def test_decode_graphs_and_the_overlap_scheduler_keep_the_features(
    fam: Family, overlap: bool
) -> None:
    """The decode graphs' padded buffers (run eagerly on the CPU) and, on top, the overlap
    scheduler (the grammar's masks applied a step late): a JSON-constrained, a seeded and a
    regex image request mixed together get the tokens each gets alone on the plain engine."""
    from pytgi_shard.engine.decode_graphs import DecodeGraphRunner

    reqs = [constrained(fam, 1, "json"), vlm(fam, 2, which=1, max_new=10, parameters=SEEDED),
            constrained(fam, 3, "regex", which=1)]
    alone = reference_run(fam.engine, reqs)
    engine = build_engine(fam.path, overlap=overlap) if overlap else fam.engine
    engine.clear(None)
    assert engine.model.graph_capturable
    graphs = DecodeGraphRunner(engine.model, (1, 2, 4), 64, engine.block_size,
                               pad_eagerly=True)
    forward, replays = graphs.forward, []

    def counted(*args: object) -> torch.Tensor:
        replays.append(1)
        return forward(*args)  # type: ignore[arg-type]

    graphs.forward = counted  # type: ignore[method-assign]
    engine.runner.decode_graphs = graphs
    try:
        run = mixed(fam, reqs, engine)
    finally:
        engine.runner.decode_graphs = None
    assert len(replays) >= 5  # the decode steps went through the graphs' buffers
    for rid in (1, 2, 3):
        assert run.tokens[rid] == alone.tokens[rid]
        torch.testing.assert_close(run.logprobs[rid], alone.logprobs[rid], rtol=TOL, atol=TOL)
    assert_valid(run.finals[1], "json")
    assert_valid(run.finals[3], "regex")


def two_rank_requests(fam: Family) -> list[pb.Request]:
    return [constrained(fam, 1, "json", params=SEEDED), vlm(fam, 2, which=1, max_new=10,
                                                              parameters=SEEDED),
            constrained(fam, 3, "regex", which=1)]


def _rank_main(rank: int, port: int, name: str, path: Path, out: Path) -> None:
    torch.set_num_threads(1)
    settings = ShardSettings(model_path=path, block_size=BLOCK, rank=rank, world_size=2,
                             master_port=port)
    engine = load_engine(settings)
    try:
        engine.warmup(pb.WarmupRequest(max_prefill_tokens=128, max_batch_total_tokens=2048))
        fam = Family(engine, *FAMILIES[name][1](path), path)
        run = mixed(fam, two_rank_requests(fam))
        engine.clear(None)
        again = resumed(fam, two_rank_requests(fam)[0], run.tokens[1][:3], chunked=True)
        torch.save((run.tokens, again.tokens[1]), out / f"rank{rank}.pt")
    finally:
        engine.dist.close()


@pytest.mark.parametrize("name", ["qwen2_vl", "paligemma"])
def test_two_ranks_keep_the_features(name: str, tmp_path: Path) -> None:
    """On two gloo ranks (the text half split, the tower replicated): the JSON-constrained
    seeded, the seeded and the regex image requests mixed, and the first resumed in chunks,
    give one rank's tokens alone."""
    write, prompts_of = FAMILIES[name]
    path = write(tmp_path / name)
    mp.spawn(_rank_main, args=(_free_port(), name, path, tmp_path), nprocs=2, join=True)
    fam = Family(build_engine(path), *prompts_of(path), path)
    alone = reference_run(fam.engine, two_rank_requests(fam))
    assert_valid(alone.finals[1], "json")
    for rank in range(2):
        tokens, again = torch.load(tmp_path / f"rank{rank}.pt")
        assert tokens == alone.tokens
        assert again == alone.tokens[1][3:]

"""Speculative decoding in the shard (--speculate, n-gram drafts): the verification step's
emission against hand-made logits (kept drafts, the rejection's correction, stops inside a kept
run), the drafting policy, and the tiny Llama's greedy tokens with drafts equal to those
without (a batch of mixed rows, chunked prefill, a resumed request)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.engine.batch import Batch
from pytgi_shard.engine.drafting import (
    DRAFTING_BATCH,
    MISSES_TO_PAUSE,
    STEP_TOKENS,
    Drafts,
    DraftState,
    plan_drafts,
)
from pytgi_shard.engine.engine import Engine
from pytgi_shard.engine.generation import choose_tokens, emit_generations
from pytgi_shard.engine.request_state import BatchContext
from pytgi_shard.engine.verification import Verifying, kept_tokens, step_drafts, verify_inputs
from pytgi_shard.output.detokenizer import Detokenizer
from pytgi_shard.output.wire import GenerationWriter
from pytgi_shard.sample.chooser import Watermark
from pytgi_shard.service.startup import load_engine
from pytgi_shard.settings import ShardSettings
from tests.tiny_models import train_tokenizer, write_tokenizer
from tests.unit.shard.engine.test_batch import batch_of, request
from tests.unit.shard.engine.test_engine import Run
from tests.unit.shard.router_steps import Router, prompt_of

VOCAB = 120
EOS = 2
SPECULATE = 3


@pytest.fixture(scope="module")
def detok(tmp_path_factory: pytest.TempPathFactory) -> Detokenizer:
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path, train_tokenizer(["Hello world! the quick fox jumps"]), 256)
    return Detokenizer.from_model_dir(path, {})


def context() -> BatchContext:
    return BatchContext(
        torch.device("cpu"), 4, 512, VOCAB, frozenset({EOS}), Watermark(), speculate=SPECULATE
    )


def word_tokens(detok: Detokenizer, count: int) -> list[int]:
    """Ids below VOCAB whose text alone is a lowercase letter (so a stop sequence can name
    one), distinct."""
    texts = detok.token_texts(list(range(VOCAB)))
    return [i for i, t in enumerate(texts) if t.isalpha() and t.islower()][:count]


def verification_step(
    batch: Batch, drafts: Drafts, argmax: dict[int, list[int]], detok: Detokenizer
) -> tuple[pb.DecodeResponse, list[int]]:
    """One verification step as the engine runs it, on logits whose argmax at each of a
    row's positions is `argmax[row]` (one token for a row without drafts)."""
    inputs = verify_inputs(batch, drafts)
    logits = torch.zeros(inputs.input_ids.shape[0], VOCAB)
    starts = inputs.last_rows.tolist()
    for row, tokens in argmax.items():
        for j, token in enumerate(tokens):
            logits[starts[row] + j, token] = 10.0
    first = logits.index_select(0, inputs.last_rows)
    choice = choose_tokens(batch, first)
    response, finished = emit_generations(
        batch, choice, detok, GenerationWriter(detok.special_ids)
    )
    finished = kept_tokens(batch, response, finished, Verifying(logits, inputs, drafts), detok)
    return response, finished


def test_kept_drafts_then_the_targets_token_and_a_rejection_s_correction(
    detok: Detokenizer,
) -> None:
    a, b, c, d, x = word_tokens(detok, 5)
    reqs = [request(0, [5, 6, 7], max_new=20), request(1, [8, 9], max_new=20),
            request(2, [10, 11], max_new=20)]
    batch = Batch.from_pb(batch_of(*reqs), context())
    assert [row for row, _ in batch.drafting] == [0, 1, 2]
    drafts = Drafts([0, 2], [[a, b, c], [a, x]])
    response, finished = verification_step(
        batch, drafts, {0: [a, b, c, d], 1: [d], 2: [a, b, c]}, detok
    )
    assert finished == []
    tokens = [list(g.tokens.ids) for g in response.generations]
    # Row 0 kept every draft and the bonus token; row 1 had none; row 2 kept `a`, then `b`
    # replaced the rejected `x` (and nothing after a rejection is kept).
    assert tokens == [[a, b, c, d], [d], [a, b]]
    assert all(len(g.tokens.logprobs) == len(g.tokens.texts) == len(g.tokens.ids)
               for g in response.generations)
    assert batch.lengths.tolist() == [7, 3, 4]
    assert batch.all_ids[0, 3:7].tolist() == [a, b, c, d]
    assert batch.last_ids.tolist() == [d, d, b]
    # Tokens each row may still append: 20 less the 4, 1 and 2 emitted.
    assert [n - batch.steps for n in batch.stops.left] == [16, 19, 18]
    assert response.drafted_tokens == 5 and response.drafted_rows == 2
    # The next step that may draft first catches the indexes up with the tokens emitted.
    step_drafts(batch, SPECULATE, len(batch))
    assert [s.index.tokens for _, s in batch.drafting] == [
        [5, 6, 7, a, b, c, d], [8, 9, d], [10, 11, a, b]]
    # The next plain step reads the right positions.
    inputs = batch.decode_inputs()
    assert inputs.positions.tolist() == [6, 2, 3]


@pytest.mark.parametrize("case", ["eos", "stop", "length"])
def test_a_stop_inside_the_kept_run_ends_the_request_where_a_plain_run_would(
    detok: Detokenizer, case: str
) -> None:
    a, b, c, d = word_tokens(detok, 4)
    second = EOS if case == "eos" else b
    stop = [detok.decode([b]).strip()] if case == "stop" else []
    max_new = 3 if case == "length" else 20
    batch = Batch.from_pb(batch_of(request(0, [5, 6, 7], max_new=max_new, stop=stop)), context())
    drafts = Drafts([0], [[a, second, c]])
    response, finished = verification_step(batch, drafts, {0: [a, second, c, d]}, detok)
    (g,) = response.generations
    assert finished == [0]
    expected = {"eos": [a, EOS], "stop": [a, b], "length": [a, second, c]}[case]
    assert list(g.tokens.ids) == expected
    reason = {"eos": pb.FINISH_REASON_EOS_TOKEN, "stop": pb.FINISH_REASON_STOP_SEQUENCE,
              "length": pb.FINISH_REASON_LENGTH}[case]
    assert g.generated_text.finish_reason == reason
    assert g.generated_text.generated_tokens == len(expected)
    assert g.generated_text.text == detok.decode(expected, skip_special_tokens=True)


def test_top_tokens_for_every_emitted_token(detok: Detokenizer) -> None:
    a, b, c, d = word_tokens(detok, 4)
    batch = Batch.from_pb(batch_of(request(0, [5, 6], max_new=9, top_n_tokens=2)), context())
    response, _ = verification_step(batch, Drafts([0], [[a, b]]), {0: [a, b, c]}, detok)
    (g,) = response.generations
    assert list(g.tokens.ids) == [a, b, c]
    assert [t.ids[0] for t in g.top_tokens] == [a, b, c]
    assert all(len(t.ids) == 2 for t in g.top_tokens)
    assert g.top_tokens[1].logprobs[0] == pytest.approx(g.tokens.logprobs[1])


def test_every_kind_of_row_drafts() -> None:
    params = [
        pb.NextTokenChooserParameters(),
        pb.NextTokenChooserParameters(do_sample=True, seed=1),
        pb.NextTokenChooserParameters(repetition_penalty=1.2),
        pb.NextTokenChooserParameters(frequency_penalty=0.5),
        pb.NextTokenChooserParameters(watermark=True),
        pb.NextTokenChooserParameters(temperature=0.5),
    ]
    reqs = [request(i, [5, 6], parameters=p) for i, p in enumerate(params)]
    batch = Batch.from_pb(batch_of(*reqs), context())
    # Greedy, sampling, penalised and watermarked rows alike (grammar rows too:
    # test_speculative_rows.py); none without --speculate.
    assert [row for row, _ in batch.drafting] == list(range(len(params)))
    off = BatchContext(torch.device("cpu"), 4, 512, VOCAB, frozenset({EOS}), Watermark())
    assert Batch.from_pb(batch_of(*reqs), off).drafting == []
    # A partial prefill's batch is dropped after its forward: no index is built for it.
    partial = request(9, [5, 6, 7, 8], chunk_len=2)
    assert Batch.from_pb(batch_of(partial), context()).drafting == []


def test_plan_respects_room_tokens_left_the_step_budget_and_back_off() -> None:
    state = DraftState.start([1, 2, 3, 4, 1, 2, 3, 4, 1, 2])
    assert plan_drafts([state], [5], [10], 4) == Drafts([0], [[3, 4, 1, 2]])
    assert plan_drafts([state], [2], [10], 4) == Drafts([0], [[3, 4]])  # KV room
    assert plan_drafts([state], [5], [3], 4) == Drafts([0], [[3, 4]])  # max_new_tokens
    assert plan_drafts([state], [5], [1], 4) is None
    assert plan_drafts([None, state], [0, 5], [1, 9], 4) == Drafts([1], [[3, 4, 1, 2]])
    # A batch larger than the drafting cap, or as large as the step's token budget, drafts
    # nothing.
    big = DRAFTING_BATCH + 1
    assert plan_drafts([state] * big, [5] * big, [9] * big, 4) is None
    assert plan_drafts([state] * big, [5] * big, [9] * big, 4, big) is not None
    assert plan_drafts([state] * STEP_TOKENS, [5] * STEP_TOKENS, [9] * STEP_TOKENS, 4,
                       STEP_TOKENS) is None
    # Missing proposals pause the request, for longer each time; a kept draft resets it.
    for _ in range(MISSES_TO_PAUSE):
        state.record(4, 0)
    pause = state.paused
    assert pause > 0
    for _ in range(pause):
        assert plan_drafts([state], [5], [10], 4) is None
    assert plan_drafts([state], [5], [10], 4) is not None
    for _ in range(MISSES_TO_PAUSE):
        state.record(4, 0)
    assert state.paused == 2 * pause
    state.record(4, 1)
    assert state.misses == 0


# The tiny Llama, served with and without drafts.


def build(model: Path, speculate: int) -> Engine:
    engine = load_engine(ShardSettings(
        model_path=model, block_size=4, overlap=False, attention="reference", speculate=speculate
    ))
    engine.warmup(pb.WarmupRequest(max_prefill_tokens=128, max_batch_total_tokens=4096))
    # Every batch here drafts (the default cap is what the CPU measured to pay).
    engine.drafting_batch = 64
    return engine


@pytest.fixture(scope="module")
def pair(tiny_model: object) -> Iterator[tuple[Engine, Engine]]:
    model = tiny_model("llama")  # type: ignore[operator]
    yield build(model, 0), build(model, SPECULATE)


class SpeculatingRouter(Router):
    """The router's growth with speculation: every running request holds its known tokens plus
    one plus the drafts' slots (step_plan.kv_tokens)."""

    def grants(self) -> list[pb.BlockGrant]:
        out = []
        for rid in list(self.cached.request_ids) if self.cached is not None else []:
            new = self.allocate(rid, self.known[rid] + 1 + self.engine.speculate)
            if new:
                out.append(pb.BlockGrant(request_id=rid, blocks=new))
        return out


def serve(engine: Engine, reqs: list[pb.Request], chunk: int = 0) -> tuple[Run, int]:
    """Every request through Prefill (in chunks of `chunk` tokens when given), then Decode to
    the end; the run and the number of Decode steps."""
    router = SpeculatingRouter(engine)
    for r in reqs:
        total = len(r.input_ids) + len(r.generated_ids)
        size = chunk or total
        for start in range(0, total, size):
            router.prefill(100 + r.id * 10 + start, [router.chunk(r, start, size)])
    steps = 0
    while router.cached is not None:
        router.decode()
        steps += 1
    return router.run, steps


def greedy(rid: int, prompt: list[int], max_new: int, **fields: object) -> pb.Request:
    stop = list(fields.pop("stop", ()))  # type: ignore[call-overload]
    return pb.Request(
        id=rid, input_ids=prompt,
        stopping_parameters=pb.StoppingCriteriaParameters(
            max_new_tokens=max_new, ignore_eos_token=True, stop_sequences=stop),
        **fields,  # type: ignore[arg-type]
    )


def test_served_greedy_tokens_equal_those_without_drafts(pair: tuple[Engine, Engine]) -> None:
    plain, speculating = pair
    sampling = pb.NextTokenChooserParameters(do_sample=True, seed=5, top_k=20)
    penalised = pb.NextTokenChooserParameters(repetition_penalty=1.3)
    reqs = [
        greedy(0, prompt_of(12, 0) * 2, 24),
        greedy(1, prompt_of(12, 1) * 2, 21, top_n_tokens=2),
        greedy(2, prompt_of(9, 2), 12, parameters=sampling),
        greedy(3, prompt_of(9, 3), 12, parameters=penalised),
    ]
    expected, plain_steps = serve(plain, reqs)
    got, steps = serve(speculating, reqs)
    assert got.tokens == expected.tokens
    for rid in expected.tokens:
        torch.testing.assert_close(got.logprobs[rid], expected.logprobs[rid], rtol=1e-4,
                                   atol=1e-4)
        assert got.finals[rid].text == expected.finals[rid].text
        assert got.finals[rid].finish_reason == expected.finals[rid].finish_reason
    tops = [[list(t.ids) for g in run.generations[1] for t in g.top_tokens]
            for run in (expected, got)]
    assert tops[0] == tops[1] and len(tops[0]) == 21
    assert steps < plain_steps, "the tiny Llama repeats itself: some drafts must be kept"


def test_chunked_prefill_resume_and_a_stop_sequence_inside_a_kept_run(
    pair: tuple[Engine, Engine],
) -> None:
    plain, speculating = pair
    prompt = prompt_of(10, 3) * 3  # its greedy run keeps runs of 3 drafts
    run, _ = serve(speculating, [greedy(0, prompt, 24)])
    tokens = run.tokens[0]
    stop, end = stop_inside_a_kept_run(run.generations[0], tokens, plain.detokenizer)
    reqs = [greedy(1, prompt, 24, stop=[stop]),
            greedy(2, prompt, 24, generated_ids=tokens[:9])]
    expected, _ = serve(plain, reqs, chunk=7)
    got, _ = serve(speculating, reqs, chunk=7)
    assert got.tokens == expected.tokens
    assert got.tokens[1] == tokens[:end]
    assert got.finals[1].finish_reason == pb.FINISH_REASON_STOP_SEQUENCE
    assert got.finals[1].text == expected.finals[1].text
    assert tokens[9:] == got.tokens[2], "a resumed request continues its tokens"
    torch.testing.assert_close(got.logprobs[2], expected.logprobs[2], rtol=1e-4, atol=1e-4)


def stop_inside_a_kept_run(
    generations: list[pb.Generation], tokens: list[int], detok: Detokenizer
) -> tuple[str, int]:
    """A stop sequence that a run first meets at a token in the middle of a step's kept run
    (the step emitted tokens after it), and the number of tokens up to and with it."""
    at = 0
    for g in generations:
        n = len(g.tokens.ids)
        if n >= 3 and at > 0:
            end = at + 2  # the step's second token
            text, before = detok.decode(tokens[:end]), detok.decode(tokens[: end - 1])
            # The shortest end of the text that its earlier text lacks (a run that repeats
            # itself has met the short ones before).
            for length in range(2, len(text) + 1):
                if text[-length:] not in before:
                    return text[-length:], end
        at += n
    raise AssertionError("no step kept 2 drafts after a fresh text: the fixture changed")


def test_overlap_runs_for_batches_too_large_to_draft(
    pair: tuple[Engine, Engine], tiny_model: object
) -> None:
    """With the overlap scheduler on, a batch above the drafting cap looks ahead and one at or
    below it drafts; as requests finish the batch moves from one to the other, and the tokens
    stay those of the plain engine."""
    plain, _ = pair
    engine = load_engine(ShardSettings(
        model_path=tiny_model("llama"),  # type: ignore[operator]
        block_size=4, overlap=True, attention="reference", speculate=SPECULATE,
    ))
    engine.warmup(pb.WarmupRequest(max_prefill_tokens=128, max_batch_total_tokens=4096))
    engine.drafting_batch = 1
    reqs = [greedy(i, prompt_of(10, 3) * 3, 8 + 8 * i) for i in range(3)]
    expected, _ = serve(plain, reqs)
    got, _ = serve(engine, reqs)
    assert got.tokens == expected.tokens
    kept = sum(len(g.tokens.ids) - 1 for g in got.generations[2])
    assert kept > 0, "the last request alone drafts"

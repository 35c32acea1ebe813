"""A step's token choice and Generations (choose_tokens, then emit_generations: one transfer,
batched stops, Generations built in place) against a plain per-request reference: the same messages,
byte for byte, step after step."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.engine.batch import Batch, ForwardInputs
from pytgi_shard.engine.generation import (
    HostTransfer,
    choose_tokens,
    emit_generations,
    pack,
    prefill_tokens,
    unpack,
)
from pytgi_shard.engine.request_state import BatchContext
from pytgi_shard.output.detokenizer import Detokenizer, TextStreams
from pytgi_shard.output.wire import GenerationWriter
from pytgi_shard.sample.chooser import Watermark
from tests.tiny_models import train_tokenizer, write_tokenizer
from tests.unit.shard.engine.test_batch import batch_of, request

VOCAB = 120
EOS = 2


@pytest.fixture(scope="module")
def detok(tmp_path_factory: pytest.TempPathFactory) -> Detokenizer:
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path, train_tokenizer(["Hello world! café 東京 🙂", "the quick fox"]), 256)
    return Detokenizer.from_model_dir(path, {})


def step(
    batch: Batch,
    logits: torch.Tensor,
    inputs: ForwardInputs,
    detok: Detokenizer,
    writer: GenerationWriter | None = None,
) -> tuple[pb.DecodeResponse, list[int]]:
    """One step's host side as the engine runs it: prompt logprobs, choose, then emit (with the
    engine's writer, which keeps token bytes from step to step)."""
    prefill = prefill_tokens(batch, logits, inputs, detok)
    last = logits if logits.shape[0] == len(batch) else logits.index_select(0, inputs.last_rows)
    writer = writer or GenerationWriter(detok.special_ids)
    return emit_generations(batch, choose_tokens(batch, last, prefill), detok, writer)


def context() -> BatchContext:
    return BatchContext(torch.device("cpu"), 4, 512, VOCAB, frozenset({EOS, 7}), Watermark())


def reference_step(
    batch: Batch, logits: torch.Tensor, detok: Detokenizer, plain: Detokenizer
) -> tuple[list[pb.Generation], list[int]]:
    """What a decode step did before the fast paths: per-request stopping and messages."""
    next_ids, logprobs = batch.chooser(logits, batch.all_ids, batch.lengths)
    chosen = logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1)
    batch.append(next_ids)
    ids, lps = next_ids.tolist(), chosen.tolist()
    texts = plain.advance(TextStreams([r.text for r in batch.requests]), ids)
    generations, finished = [], []
    for r, token, lp, text in zip(batch.requests, ids, lps, texts, strict=True):
        g = pb.Generation(
            request_id=r.id,
            tokens=pb.Tokens(
                ids=[token], logprobs=[lp], texts=[text], is_special=[token in detok.special_ids]
            ),
        )
        reason = r.stopping(token, text)
        if reason is not None:
            g.generated_text.CopyFrom(
                pb.GeneratedText(
                    text=detok.decode(r.text.generated_ids, skip_special_tokens=True),
                    generated_tokens=r.stopping.generated,
                    finish_reason=reason,  # type: ignore[arg-type]
                    seed=r.seed,
                )
            )
            finished.append(r.id)
        generations.append(g)
    return generations, finished


def mixed_batch() -> pb.Batch:
    params = [
        pb.NextTokenChooserParameters(),
        pb.NextTokenChooserParameters(do_sample=True, seed=3, top_k=5),
        pb.NextTokenChooserParameters(repetition_penalty=1.3),
    ]
    stops = [[], list("aeiou"), ["o w", *"!#%&()*+"], []]
    reqs = [
        request(
            i,
            [3 + (5 * i + j) % 90 for j in range(1 + i % 4)],
            max_new=2 + (7 * i) % 9,
            stop=stops[i % 4],
            ignore_eos=i % 3 == 0,
            parameters=params[i % 3],
        )
        for i in range(10)
    ]
    return batch_of(*reqs)


def test_decode_steps_give_the_reference_messages(detok: Detokenizer) -> None:
    plain = Detokenizer(detok.tokenizer, piece_table=False)
    writer = GenerationWriter(detok.special_ids)
    fast, slow = (Batch.from_pb(mixed_batch(), context()) for _ in range(2))
    gen = torch.Generator().manual_seed(0)
    finished_any = set()
    for _ in range(12):
        # Peaked logits over the first tokens, EOS likely now and then.
        logits = torch.randn(len(fast), VOCAB, generator=gen) * 4
        logits[:, EOS] += 7
        inputs = fast.decode_inputs()
        response, done = step(fast, logits.clone(), inputs, detok, writer)
        expected, expected_done = reference_step(slow, logits.clone(), detok, plain)
        assert done == expected_done
        assert [g.SerializeToString() for g in response.generations] == [
            g.SerializeToString() for g in expected
        ]
        finished_any |= {
            g.generated_text.finish_reason for g in expected if g.HasField("generated_text")
        }
        if not done:
            continue
        keep = [i for i in fast.request_ids if i not in done]
        if not keep:
            break
        fast, slow = fast.filter(keep), slow.filter(keep)
    assert len(finished_any) == 3, "length, EOS and stop sequence must all occur"


def test_one_transfer_holds_ids_and_logprobs_exactly() -> None:
    ids = torch.tensor([0, 5, 2**31 - 1, 2**40 + 3])
    lps = torch.tensor([-0.1234567, float("-inf"), float("nan"), -1e-30], dtype=torch.float32)
    got_ids, got_lps = unpack(pack(ids, lps))
    assert got_ids == ids.tolist()
    expected = lps.tolist()
    assert got_lps[:2] + got_lps[3:] == expected[:2] + expected[3:] and math.isnan(got_lps[2])
    assert all(type(i) is int for i in got_ids)
    half = torch.tensor([-0.3333, -7.5], dtype=torch.bfloat16)
    assert unpack(pack(ids[:2], half))[1] == half.tolist()
    # On the CPU the lists come straight from the tensors: the same values.
    on_cpu = HostTransfer(ids, lps).wait()
    assert on_cpu[0] == got_ids and math.isnan(on_cpu[1][2])


def test_prefill_step_keeps_prefill_and_top_tokens(detok: Detokenizer, tmp_path: Path) -> None:
    """The first step of a batch: prompt logprobs and top tokens where asked, nowhere else."""
    reqs = [
        request(0, [5, 6, 7], prefill_logprobs=True, top_n_tokens=2),
        request(1, [8, 9], max_new=1),
    ]
    batch = Batch.from_pb(batch_of(*reqs), context())
    inputs = batch.prefill_inputs()
    rows = inputs.lm_head_indices
    assert rows is not None
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(1))
    response, done = step(batch, logits, inputs, detok)
    first, second = response.generations
    assert list(first.prefill_tokens.ids) == [5, 6, 7] and math.isnan(
        first.prefill_tokens.logprobs[0]
    )
    expected = torch.log_softmax(logits[:2], -1)[[0, 1], [6, 7]].tolist()
    assert list(first.prefill_tokens.logprobs)[1:] == pytest.approx(expected)
    assert len(first.top_tokens) == 1 and len(first.top_tokens[0].ids) == 2
    assert not second.HasField("prefill_tokens") and not second.top_tokens
    assert done == [1] and second.generated_text.finish_reason == pb.FINISH_REASON_LENGTH

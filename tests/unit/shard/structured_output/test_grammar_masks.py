"""Grammar masks without a model: bitmask words to the CPU's bias (the byte table's gather) and
the device's banned tokens (both agree with a per-bit reference), either applied to some or all
rows exactly as the reference masked fill, the bias buffer reused and grown, the grammar fields of
the wire, and the compiled-grammar cache."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.errors import InvalidRequest
from pytgi_shard.sample.chooser import NEG_INF, ban_tokens
from pytgi_shard.structured_output.compiler import GrammarCompiler, GrammarSpec
from pytgi_shard.structured_output.masks import (
    HostBias,
    SharedBias,
    byte_bias_table,
    host_masks,
    unpack_with_torch,
)
from pytgi_shard.structured_output.worker import MaskWorker
from tests.tiny_models import _CORPUS, train_tokenizer


def reference_banned(words: torch.Tensor, vocab: int) -> torch.Tensor:
    out = torch.zeros(words.shape[0], vocab, dtype=torch.bool)
    for r in range(words.shape[0]):
        for t in range(vocab):
            out[r, t] = not (int(words[r, t // 32]) >> (t % 32)) & 1
    return out


def random_words(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (rows, (vocab + 31) // 32)
    return torch.randint(-(2**31), 2**31 - 1, shape, generator=g, dtype=torch.int64).to(torch.int32)


def test_the_byte_table_holds_each_bytes_bits_little_endian() -> None:
    table = byte_bias_table()
    assert table.shape == (256, 8) and table.dtype == torch.float32
    for byte in range(256):
        for bit in range(8):
            assert table[byte, bit] == (0.0 if (byte >> bit) & 1 else NEG_INF)


@pytest.mark.parametrize("vocab", [32, 45, 100, 257])
def test_host_and_device_unpacking_match_the_per_bit_reference(vocab: int) -> None:
    words = random_words(3, vocab, vocab)
    words[0, 0] = -1  # every bit set: 0.0 throughout, and the sign bit's token allowed
    words[1, -1] = 0
    expected = reference_banned(words, vocab)
    bias = HostBias()(words, vocab)
    assert bias.shape == (3, vocab) and bias.dtype == torch.float32
    assert torch.equal(bias == NEG_INF, expected)
    assert torch.equal(bias[~expected], torch.zeros(int((~expected).sum())))
    assert torch.equal(unpack_with_torch(words, vocab), expected)


@pytest.mark.parametrize("as_bias", [False, True])
def test_masks_apply_to_the_listed_rows_only_as_the_masked_fill(as_bias: bool) -> None:
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(4, 10, generator=g)
    scores[0, 0] = -0.0  # a zero logit stays a zero (its sign is never observable later)
    scores[1, 2] = 1e30
    banned = torch.rand(2, 10, generator=g) < 0.5
    masks = torch.zeros(2, 10).masked_fill_(banned, NEG_INF) if as_bias else banned
    out = scores.clone()
    ban_tokens(out, torch.tensor([1, 3]), masks)
    expected = scores.clone()
    expected[1][banned[0]] = NEG_INF
    expected[3][banned[1]] = NEG_INF
    assert torch.equal(out, expected)
    every = scores[[1, 3]].clone()
    ban_tokens(every, None, masks)
    assert torch.equal(every, expected[[1, 3]])


def test_the_host_bias_reuses_its_buffer_and_grows_it_when_needed() -> None:
    host = HostBias()
    first = host(torch.full((3, 2), -1, dtype=torch.int32), 40)
    assert torch.equal(first, torch.zeros(3, 40))
    second = host(torch.zeros((2, 2), dtype=torch.int32), 40)
    assert second.data_ptr() == first.data_ptr()  # room for 2 rows in the 3 rows' buffer
    assert torch.equal(second, torch.full((2, 40), NEG_INF))
    words = random_words(5, 70, 1)
    grown = host(words, 70)
    assert torch.equal(grown == NEG_INF, reference_banned(words, 70))


def test_the_host_bias_applied_to_some_rows_is_the_reference_masked_fill() -> None:
    vocab = 45
    words = random_words(2, vocab, 3)
    scores = torch.randn(4, vocab, generator=torch.Generator().manual_seed(3))
    out = scores.clone()
    ban_tokens(out, torch.tensor([2, 0]), HostBias()(words, vocab))
    expected = scores.clone()
    banned = reference_banned(words, vocab)
    expected[2][banned[0]] = NEG_INF
    expected[0][banned[1]] = NEG_INF
    assert torch.equal(out, expected)


@pytest.mark.parametrize(
    ("batch", "rows", "pattern", "shared"),
    [
        (6, [0, 1, 2, 3, 4, 5], [0, 0, 0, 1, 1, 1], True),  # two runs
        (6, [0, 1, 2, 3, 4, 5], [0, 0, 0, 0, 0, 0], True),  # one mask for the batch
        (7, [0, 1, 2, 4, 5, 6], [0, 0, 0, 0, 0, 0], True),  # a free row splits the run
        (6, [0, 1, 2, 3, 4, 5], [0, 1, 0, 1, 0, 1], False),  # equal but never consecutive
        (4, [3, 2, 1, 0], [0, 0, 0, 0], False),  # consecutive in the words, not in the batch
    ],
)
def test_rows_sharing_a_mask_are_biased_as_the_reference_masked_fill(
    batch: int, rows: list[int], pattern: list[int], shared: bool
) -> None:
    vocab = 45
    distinct = random_words(2, vocab, 5)
    words = distinct[pattern]
    masks = host_masks(HostBias(), words, vocab, rows, shared_from=0)
    assert isinstance(masks, SharedBias) == shared
    # Below shared_from scores every row gets its own bias, runs or not.
    assert not isinstance(host_masks(HostBias(), words, vocab, rows), SharedBias)
    scores = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(5))
    out = scores.clone()
    index = None if rows == list(range(batch)) else torch.tensor(rows)
    ban_tokens(out, index, masks)
    expected = scores.clone()
    banned = reference_banned(words, vocab)
    for j, row in enumerate(rows):
        expected[row][banned[j]] = NEG_INF
    assert torch.equal(out, expected)


def test_run_biases_are_kept_by_content_across_steps_and_evicted_oldest_first() -> None:
    vocab = 70
    words = random_words(4, vocab, 11).numpy()
    host = HostBias(kept_rows=2)
    first = host.rows(words[[0, 1]], vocab)
    banned = reference_banned(torch.from_numpy(words), vocab)
    for j, bias in enumerate(first):
        assert bias.shape == (vocab,) and torch.equal(bias == NEG_INF, banned[j])
    # The per-row buffer is written over by every call; the kept rows are tensors of their own.
    host(torch.from_numpy(words[[2, 3]]), vocab)
    again = host.rows(words[[1, 0]], vocab)
    assert again[0] is first[1] and again[1] is first[0]
    assert torch.equal(again[1] == NEG_INF, banned[0])
    # A third mask evicts the least recently used (row 1's), which is then made anew.
    host.rows(words[[2]], vocab)
    assert host.rows(words[[0]], vocab)[0] is first[0]
    remade = host.rows(words[[1]], vocab)[0]
    assert remade is not first[1] and torch.equal(remade, first[1])


def test_grammar_fields_of_the_wire() -> None:
    assert GrammarSpec.from_pb(pb.NextTokenChooserParameters()) is None
    spec = GrammarSpec.from_pb(
        pb.NextTokenChooserParameters(grammar="a+", grammar_type=pb.GRAMMAR_TYPE_REGEX)
    )
    assert spec == GrammarSpec(pb.GRAMMAR_TYPE_REGEX, "a+")
    with pytest.raises(InvalidRequest, match="GRAMMAR_TYPE_NONE"):
        GrammarSpec.from_pb(pb.NextTokenChooserParameters(grammar="a+"))


@pytest.mark.parametrize("through_executor", [False, True])
def test_a_mask_computation_writes_every_word_of_its_row(through_executor: bool) -> None:
    """grammar_batch._masks hands llguidance an unzeroed buffer: what it leaves there must not
    depend on what was there before, in a fresh, an advanced, and an error state."""
    import llguidance
    import numpy as np

    from pytgi_shard.structured_output.compiler import build_matcher, grammar_source

    tokenizer: Tokenizer = train_tokenizer(_CORPUS)
    worker = MaskWorker()
    if through_executor:
        worker.executor = llguidance.LLExecutor()
    compiler = GrammarCompiler(tokenizer.to_str(), 400, [1], worker)
    source = grammar_source(GrammarSpec(pb.GRAMMAR_TYPE_REGEX, "[ab]+c"))
    fresh, advanced, errored = (
        build_matcher(compiler.tokenizer, source, compiler.mask_width).matcher for _ in range(3)
    )
    allowed = np.zeros((1, compiler.mask_width), dtype=np.int32)
    worker.fill_masks([fresh], allowed)
    first = next(t for t in range(400) if (allowed[0, t // 32] >> (t % 32)) & 1)
    banned = next(t for t in range(400) if not (allowed[0, t // 32] >> (t % 32)) & 1)
    assert advanced.consume_token(first)
    assert not errored.consume_token(banned) and errored.is_error()
    matchers = [fresh, advanced, errored]
    zeroed = np.zeros((3, compiler.mask_width), dtype=np.int32)
    dirty = np.full((3, compiler.mask_width), 0x5A5A5A5A, dtype=np.int32)
    worker.fill_masks(matchers, zeroed)
    worker.fill_masks(matchers, dirty)
    assert np.array_equal(zeroed, dirty)

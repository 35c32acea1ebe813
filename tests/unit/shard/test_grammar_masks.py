"""Grammar masks without a model: bitmask words to the CPU's bias and the device's banned
tokens (both agree with a per-bit reference), either applied to some or all rows exactly as the
reference masked fill, buffers reused only once given back, the grammar fields of the wire, and
the compiled-grammar cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.errors import InvalidRequest
from pytgi_shard.grammar import GrammarCompiler, GrammarSpec
from pytgi_shard.grammar_masks import BiasBuffers, bias_on_host, unpack_with_torch
from pytgi_shard.grammar_worker import MaskWorker
from pytgi_shard.sampling import NEG_INF, ban_tokens
from tests.tiny_models import _CORPUS, train_tokenizer


def reference_banned(words: torch.Tensor, vocab: int) -> torch.Tensor:
    out = torch.zeros(words.shape[0], vocab, dtype=torch.bool)
    for r in range(words.shape[0]):
        for t in range(vocab):
            out[r, t] = not (int(words[r, t // 32]) >> (t % 32)) & 1
    return out


@pytest.mark.parametrize("vocab", [32, 45, 100])
def test_host_and_device_unpacking_match_the_per_bit_reference(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    words = torch.randint(-(2**31), 2**31 - 1, (3, (vocab + 31) // 32), generator=g, dtype=torch.int64)
    words = words.to(torch.int32)
    expected = reference_banned(words, vocab)
    bias, _ = bias_on_host(words.numpy(), vocab, BiasBuffers())
    assert bias.dtype == torch.float32
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


def test_bias_buffers_are_reused_only_once_given_back() -> None:
    buffers = BiasBuffers(keep=1)
    words = np.full((3, 2), -1, dtype=np.int32)
    first, buffer = bias_on_host(words, 40, buffers)
    second, other = bias_on_host(words, 40, buffers)
    assert other is not buffer
    buffers.give_back(buffer)
    third, again = bias_on_host(np.zeros((2, 2), dtype=np.int32), 40, buffers)
    assert again is buffer  # room for 2 rows in a 3-row buffer
    assert torch.equal(third, torch.full((2, 40), NEG_INF))
    assert torch.equal(second, torch.zeros(3, 40))


def test_grammar_fields_of_the_wire() -> None:
    assert GrammarSpec.from_pb(pb.NextTokenChooserParameters()) is None
    spec = GrammarSpec.from_pb(
        pb.NextTokenChooserParameters(grammar="a+", grammar_type=pb.GRAMMAR_TYPE_REGEX)
    )
    assert spec == GrammarSpec(pb.GRAMMAR_TYPE_REGEX, "a+")
    with pytest.raises(InvalidRequest, match="GRAMMAR_TYPE_NONE"):
        GrammarSpec.from_pb(pb.NextTokenChooserParameters(grammar="a+"))


def test_the_cache_keeps_the_most_recently_used_grammars() -> None:
    tokenizer: Tokenizer = train_tokenizer(_CORPUS)
    compiler = GrammarCompiler(tokenizer.to_str(), 400, [1], MaskWorker(), capacity=2)
    a, b, c = (GrammarSpec(pb.GRAMMAR_TYPE_REGEX, r) for r in ("a+", "b+", "c+"))
    first = compiler.compile(a)
    compiler.compile(b)
    assert compiler.compile(a) is first
    compiler.compile(c)
    assert len(compiler) == 2
    assert (compiler.stats.hits, compiler.stats.misses) == (1, 3)
    compiler.compile(b)
    assert (compiler.stats.hits, compiler.stats.misses) == (1, 4)
    assert compiler.mask_width == (400 + 31) // 32

"""The row-blocked greedy choice of a constrained batch gives exactly what the whole-batch path
gives (ban, first_max, log_softmax): every mask form the CPU uses, constrained rows all, some
consecutive, some scattered, blocks that divide the batch or not; and the chooser takes it only
for greedy batches whose logits are large enough."""

from __future__ import annotations

import pytest
import torch

from pytgi_shard.sample.argmax import first_max
from pytgi_shard.sample.blocked_choice import BLOCKED_FROM, block_rows, blocked_greedy
from pytgi_shard.sample.chooser import NextTokenChooser, SamplingParams, Watermark, ban_tokens
from pytgi_shard.structured_output.masks import HostBias, SharedBias, host_masks


def random_words(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (rows, (vocab + 31) // 32)
    return torch.randint(-(2**31), 2**31 - 1, shape, generator=g, dtype=torch.int64).to(torch.int32)


def whole_batch(
    scores: torch.Tensor, rows: torch.Tensor | None, masks: torch.Tensor | SharedBias
) -> tuple[torch.Tensor, torch.Tensor]:
    out = scores.clone()
    ban_tokens(out, rows, masks)
    return first_max(out), torch.log_softmax(out, dim=-1)


@pytest.mark.parametrize("block", [1, 3, 4, 16])
@pytest.mark.parametrize(
    ("batch", "rows", "pattern"),
    [
        (10, None, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]),  # every row, each its own mask
        (10, None, [0, 0, 0, 0, 1, 1, 1, 1, 1, 1]),  # every row, two runs sharing masks
        (10, [2, 3, 4, 5], [0, 1, 2, 3]),  # some rows, consecutive
        (10, [0, 3, 4, 9], [0, 1, 2, 3]),  # some rows, scattered
        (10, [1, 2, 3, 6, 7, 8], [0, 0, 0, 1, 1, 1]),  # runs with free rows between
    ],
)
def test_blocks_give_the_whole_batch_ids_and_logprobs(
    block: int, batch: int, rows: list[int] | None, pattern: list[int]
) -> None:
    vocab = 300
    words = random_words(max(pattern) + 1, vocab, block)[pattern]
    words[0, 0] |= 1 << 5  # some allowed token in every row (a grammar always allows one)
    listed = list(range(batch)) if rows is None else rows
    index = None if rows is None else torch.tensor(rows)
    g = torch.Generator().manual_seed(batch + block)
    scores = torch.randn(batch, vocab, generator=g)
    for shared_from in (0, 1 << 30):  # runs as a SharedBias where they are, and never
        masks = host_masks(HostBias(), words, vocab, listed, shared_from=shared_from)
        if isinstance(masks, torch.Tensor):
            masks = masks.clone()  # HostBias' buffer is rewritten by the next call
        expected_ids, expected_logprobs = whole_batch(scores, index, masks)
        out = scores.clone()
        ids = blocked_greedy(out, index, masks, block)
        assert torch.equal(ids, expected_ids)
        assert torch.equal(out, expected_logprobs)


def test_bool_masks_are_refused() -> None:
    with pytest.raises(ValueError, match="float32 bias"):
        blocked_greedy(torch.zeros(2, 8), None, torch.zeros(2, 8, dtype=torch.bool), 1)


def test_only_large_contiguous_cpu_logits_are_blocked_by_about_l2_of_rows() -> None:
    assert block_rows(torch.empty(64, 4096)) is None
    assert block_rows(torch.empty(64, 128256)) == 4
    assert block_rows(torch.empty(BLOCKED_FROM // 32768, 32768)) == 16
    assert block_rows(torch.empty(128256, 64).t()) is None


@pytest.mark.parametrize(
    ("params", "greedy_only"),
    [
        (SamplingParams(), True),
        (SamplingParams(temperature=0.5), False),
        (SamplingParams(repetition_penalty=1.2), False),
        (SamplingParams(top_k=5), False),
        (SamplingParams(do_sample=True, seed=3), False),
    ],
)
def test_the_chooser_blocks_greedy_batches_and_agrees_with_the_whole_batch(
    params: SamplingParams, greedy_only: bool
) -> None:
    rows, vocab = 8, BLOCKED_FROM // 8  # just large enough to be blocked
    plain = [SamplingParams()] * (rows - 1)
    chooser = NextTokenChooser.create([params, *plain], torch.device("cpu"), Watermark())
    assert chooser.greedy_only == greedy_only
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=g)
    words = random_words(1, vocab, 1).repeat(rows, 1)
    masks = host_masks(HostBias(), words, vocab, list(range(rows)))
    assert isinstance(masks, SharedBias)
    history = torch.zeros(rows, 1, dtype=torch.long)
    lengths = torch.ones(rows, dtype=torch.long)
    ids, logprobs = chooser(logits.clone(), history, lengths, (None, masks))
    again = NextTokenChooser.create([params, *plain], torch.device("cpu"), Watermark())
    again.greedy_only = False  # the whole-batch path, for the same batch
    expected_ids, expected_logprobs = again(logits.clone(), history, lengths, (None, masks))
    assert torch.equal(ids, expected_ids)
    assert torch.equal(logprobs, expected_logprobs)

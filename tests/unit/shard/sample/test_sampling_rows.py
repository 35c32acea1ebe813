"""Each row of a batch is chosen as if it ran alone: its ids, logprobs and top tokens do not
depend on its neighbours' parameters, on the batch's size, nor on its place in it.

The "model" here gives each request logits that depend on its own history only (a row of a
fixed table picked by its last token and step), so any difference between a request's solo
run and its runs inside batches comes from the chooser. The real forward's logits are not
batch-invariant on the CPU (matmul blocking; README), which these tests leave out on purpose.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch

from pytgi_shard.sample.candidate_warpers import entropy
from pytgi_shard.sample.categorical import row_sums
from pytgi_shard.sample.chooser import NextTokenChooser, SamplingParams, Watermark, top_tokens

CPU = torch.device("cpu")
VOCAB = 4096
TABLE_ROWS = 37
STEPS = 64
NEG_INF = float("-inf")


def logits_table() -> torch.Tensor:
    """Random rows, some flat, some peaked (a softmax that underflows over most of the row at
    a low temperature: where a float32 running mass reaches 1.0 early)."""
    generator = torch.Generator().manual_seed(1234)
    table = torch.randn(TABLE_ROWS, VOCAB, generator=generator)
    table *= torch.linspace(0.5, 6.0, TABLE_ROWS).unsqueeze(1)
    table[::5, :3] += 12.0
    return table


TABLE = logits_table()


@dataclass
class Request:
    """One request: its parameters, its top-n, an optional fixed grammar-like ban (a float32
    bias, 0 where allowed, -inf where banned), and what it produced step by step."""

    params: SamplingParams
    top_n: int = 0
    banned: torch.Tensor | None = None
    prompt: list[int] = field(default_factory=lambda: [5, 17, 2048, 5])
    ids: list[int] = field(default_factory=list)
    logprobs: list[torch.Tensor] = field(default_factory=list)
    tops: list[tuple[list[int], list[float]]] = field(default_factory=list)

    def logits(self) -> torch.Tensor:
        """This step's logits: a function of this request's own history only."""
        history = self.prompt + self.ids
        return TABLE[(history[-1] * 7 + len(self.ids)) % TABLE_ROWS]


def ban_allowing(count: int, offset: int) -> torch.Tensor:
    bias = torch.full((VOCAB,), NEG_INF)
    bias[offset : offset + count] = 0.0
    return bias


def requests() -> list[Request]:
    """One request per processor and warper, neutral values beside non-neutral ones; two of
    them are the issue's (X: typical-p 0.5; Y: temperature 0.3, top-k 5, top-n 2)."""
    s = SamplingParams
    return [
        Request(s()),
        Request(s(), top_n=3),
        Request(s(do_sample=True, seed=7, typical_p=0.5)),
        Request(s(do_sample=True, seed=1426116663, temperature=0.3, top_k=5), top_n=2),
        Request(s(do_sample=True, seed=3, temperature=0.1), top_n=5),
        Request(s(do_sample=True, seed=11, top_p=0.9), top_n=4),
        Request(s(top_k=40, top_p=0.8, typical_p=0.9, seed=13), top_n=3),
        Request(s(repetition_penalty=1.3)),
        Request(s(do_sample=True, seed=5, temperature=0.9, repetition_penalty=0.7), top_n=2),
        Request(s(do_sample=True, seed=9, frequency_penalty=0.5)),
        Request(s(do_sample=True, seed=21, temperature=0.9, watermark=True), top_n=1),
        Request(s(do_sample=True, seed=1046, temperature=0.9), top_n=1),
        Request(s(top_k=1, seed=4)),
        Request(s(top_k=20, typical_p=0.95, seed=8), top_n=2),
        Request(s(do_sample=True, seed=17, top_p=0.95), banned=ban_allowing(300, 100)),
        Request(s(), top_n=2, banned=ban_allowing(50, 4000)),
    ]


def step(batch: list[Request], chooser: NextTokenChooser) -> None:
    """One decode step of `batch` (rows in this order) through `chooser`."""
    histories = [r.prompt + r.ids for r in batch]
    width = max(len(h) for h in histories)
    history = torch.zeros(len(batch), width, dtype=torch.long)
    for row, h in enumerate(histories):
        history[row, : len(h)] = torch.tensor(h)
    lengths = torch.tensor([len(h) for h in histories])
    logits = torch.stack([r.logits() for r in batch])
    constrained = [row for row, r in enumerate(batch) if r.banned is not None]
    banned = None
    if constrained:
        masks = torch.stack([batch[row].banned for row in constrained])  # type: ignore[misc]
        rows = None if len(constrained) == len(batch) else torch.tensor(constrained)
        banned = (rows, masks)
    next_ids, logprobs = chooser(logits, history, lengths, banned)
    tops = top_tokens(logprobs, [r.top_n for r in batch])
    for row, r in enumerate(batch):
        r.ids.append(int(next_ids[row]))
        r.logprobs.append(logprobs[row].clone())
        r.tops.append(tops[row])


def run(schedule: list[list[int]], pool: list[Request], noise: bool = False) -> None:
    """Decodes `pool`'s requests along `schedule` (per step, which of them form the batch, in
    that order), each with its own generator carried from batch to batch; `noise`: sampling
    rows draw as on an accelerator (argmax of p / E), not by the CPU's inverse transform."""
    choosers = [NextTokenChooser.create([r.params], CPU, Watermark()) for r in pool]
    for members in schedule:
        chooser = NextTokenChooser.concatenate([choosers[i] for i in members])
        chooser.inverse_transform = not noise
        step([pool[i] for i in members], chooser)


@functools.cache
def solo_runs() -> list[Request]:
    """Each request of `requests()` run alone for STEPS steps (once per test session)."""
    pool = requests()
    for i in range(len(pool)):
        run([[i]] * STEPS, pool)
    return pool


def random_schedule(count: int, seed: int, members: list[int]) -> list[list[int]]:
    """Batches of random size and order drawn from `members` until each has STEPS tokens."""
    rng = random.Random(seed)
    left = {i: STEPS for i in members}
    schedule = []
    while left:
        batch = rng.sample(sorted(left), rng.randint(1, min(count, len(left))))
        for i in batch:
            left[i] -= 1
            if not left[i]:
                del left[i]
        schedule.append(batch)
    return schedule


def assert_same_as_solo(
    pool: list[Request], members: list[int], solo: list[Request] | None = None
) -> None:
    for i in members:
        alone, batched = (solo or solo_runs())[i], pool[i]
        assert batched.ids == alone.ids, f"request {i}: {batched.params}"
        for t in range(STEPS):
            assert torch.equal(batched.logprobs[t], alone.logprobs[t]), f"request {i} step {t}"
        assert batched.tops == alone.tops, f"request {i}: {batched.params}"


EVERY = list(range(len(requests())))
# Rows that all have a top-k: the warpers' candidate path.
TOP_K_ROWS = [3, 6, 12, 13]


@pytest.mark.parametrize(
    "schedule",
    [
        pytest.param([EVERY] * STEPS, id="all-at-once"),
        pytest.param([TOP_K_ROWS] * STEPS, id="top-k-rows"),
        pytest.param([[2, 3]] * STEPS, id="the-issue's-pair"),
        pytest.param(random_schedule(16, 1, EVERY), id="random-1-to-16-rows"),
        pytest.param(random_schedule(3, 2, TOP_K_ROWS), id="random-top-k-rows"),
    ],
)
def test_every_row_of_a_mixed_batch_is_chosen_as_in_its_solo_run(
    schedule: list[list[int]],
) -> None:
    pool = requests()
    run(schedule, pool)
    assert_same_as_solo(pool, sorted({i for batch in schedule for i in batch}))


def test_the_solo_runs_sample_and_use_their_warpers() -> None:
    # The comparisons above mean something: the sampling rows do not repeat one token, and
    # the warped and banned rows keep fewer tokens than the vocabulary.
    solo = solo_runs()
    for i in (2, 4, 5, 8, 9, 10, 11):
        assert len(set(solo[i].ids)) > 3, solo[i].params
    for i in (2, 3, 5, 6, 13, 14, 15):
        assert all(int(lp.isfinite().sum()) < VOCAB for lp in solo[i].logprobs)
    assert all(100 <= t < 400 for t in solo[14].ids)


def test_a_neutral_row_keeps_every_token_beside_warped_rows() -> None:
    # The numbers: a top_p = 1.0 row at temperature 0.1 kept 332 of 4,096 tokens
    # beside a top-p row; Y's second top token vanished beside X (typical-p 0.5).
    pool = requests()
    run([[5, 4], [2, 3]], pool)
    assert bool(pool[4].logprobs[0].isfinite().all())
    assert pool[3].tops[0] == solo_runs()[3].tops[0]
    assert len(pool[3].tops[0][0]) == 2


def test_the_accelerators_draw_by_noise_is_the_same_in_a_batch_as_alone() -> None:
    # The GPU's way (exponential noise from each request's generator), run on the CPU.
    members = [2, 3, 4, 5, 8, 11, 14]
    solo, pool = requests(), requests()
    for i in members:
        run([[i]] * STEPS, solo, noise=True)
    run(random_schedule(7, 3, members), pool, noise=True)
    assert_same_as_solo(pool, members, solo)
    assert solo[11].ids != solo_runs()[11].ids  # the other way to draw, indeed
    assert len(set(solo[11].ids)) > 3


@pytest.fixture
def four_threads() -> Iterator[None]:
    """torch on 4 threads, as a serving machine has at least: a reduction over one long row
    is then split among them (with 1 thread nothing is, and these tests could not fail)."""
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("four_threads")
def test_typical_p_entropy_of_a_row_is_the_same_alone_and_in_a_batch() -> None:
    # Llama 3's and Qwen2's vocabularies: typical-p's entropy of a request alone (or the only
    # typical-p row of its batch) was summed across threads, in a batch by one thread.
    for vocab in (128256, 152064):
        g = torch.Generator().manual_seed(vocab)
        logp = torch.log_softmax(torch.randn(4, vocab, generator=g) * 3, dim=-1)
        logp[1, ::3] = NEG_INF
        alone = [entropy(logp[i : i + 1]) for i in range(4)]
        for rows in (2, 3, 4):
            together = entropy(logp[:rows])
            for i in range(rows):
                assert torch.equal(together[i], alone[i][0]), (vocab, rows, i)
        expected = -(logp.double() * logp.double().exp()).nansum(dim=-1, keepdim=True)
        torch.testing.assert_close(entropy(logp).double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("four_threads")
def test_row_sums_of_a_row_are_the_same_alone_and_in_a_batch() -> None:
    g = torch.Generator().manual_seed(0)
    values = torch.rand(3, 262144 + 5, generator=g)
    alone = row_sums(values[:1])
    assert torch.equal(row_sums(values)[0], alone[0])
    torch.testing.assert_close(alone.double(), values[:1].double().sum(-1, keepdim=True))


@pytest.mark.usefixtures("four_threads")
def test_a_typical_p_request_at_a_large_vocabulary_is_chosen_as_alone() -> None:
    vocab, steps = 152064, 8
    g = torch.Generator().manual_seed(5)
    table = torch.randn(steps, 3, vocab, generator=g) * 2
    subject = SamplingParams(do_sample=True, seed=1046, typical_p=0.9, temperature=0.9)
    others = [SamplingParams(), SamplingParams(do_sample=True, seed=2, top_p=0.5)]
    history, lengths = torch.zeros(3, 1, dtype=torch.long), torch.ones(3, dtype=torch.long)

    def decode(params: list[SamplingParams]) -> list[tuple[int, torch.Tensor]]:
        chooser, rows = NextTokenChooser.create(params, CPU, Watermark()), len(params)
        out = []
        for t in range(steps):
            ids, logprobs = chooser(table[t, :rows].clone(), history[:rows], lengths[:rows])
            out.append((int(ids[0]), logprobs[0].clone()))
        return out

    alone = decode([subject])
    for batch in ([subject, others[0]], [subject, *others]):
        for (a, lp_a), (b, lp_b) in zip(alone, decode(batch), strict=True):
            assert a == b and torch.equal(lp_a, lp_b)

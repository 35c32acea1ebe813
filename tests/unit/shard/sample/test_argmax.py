"""first_max against torch.argmax: ties, infinities, NaN, on both the chunked CPU path and the
plain one."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pytgi_shard.sample.argmax import CHUNK, CHUNKED_FROM, chunked_first_max, first_max

_SCORES = st.sampled_from([0.0, 1.0, 2.0, -1.5, float("inf"), float("-inf"), float("nan")])


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    rows=st.integers(1, 5),
    chunk=st.sampled_from([1, 2, 3, 8]),
    chunks=st.integers(1, 9),
    nan=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_chunked_first_max_is_argmax(
    data: st.DataObject, rows: int, chunk: int, chunks: int, nan: bool, dtype: torch.dtype
) -> None:
    n = chunk * chunks
    values = data.draw(st.lists(_SCORES, min_size=rows * n, max_size=rows * n))
    scores = torch.tensor(values).view(rows, n)
    if not nan:
        scores = scores.nan_to_num(nan=0.5, posinf=float("inf"), neginf=float("-inf"))
    scores = scores.to(dtype)
    assert torch.equal(chunked_first_max(scores, chunk), scores.argmax(dim=-1))


def test_first_max_takes_the_chunked_path_on_whole_chunks_and_max_elsewhere() -> None:
    torch.manual_seed(0)
    rows = CHUNKED_FROM // CHUNK
    for n in (3 * CHUNK, 5 * CHUNK + 1, CHUNK, 7):
        scores = torch.randint(0, 4, (rows, n)).float()
        scores[2] = float("-inf")
        scores[3, n // 2] = float("nan")
        assert torch.equal(first_max(scores), scores.argmax(dim=-1))
    wide = torch.randn(rows, 4 * CHUNK)
    assert torch.equal(first_max(wide[:, ::2]), wide[:, ::2].argmax(dim=-1))

"""Decode attention written for a compiler (shard/attention/compiled_decode.py): run eagerly, it
attends as the reference backend's gathered SDPA does, for every feature a decode step may use."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from pytgi_shard.attention import AttentionMetadata, get_backend
from pytgi_shard.attention.kv_quant import KVScales
from pytgi_shard.attention.plans import AttentionPlans

# Per request: the tokens cached before this decode step (each adds one).
CACHED = [6, 0, 31, 15, 2]


def attend(meta: AttentionMetadata, caches: tuple[torch.Tensor, torch.Tensor],
           inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], **features: object
           ) -> torch.Tensor:
    """The reference backend's decode step over copies of `caches` (each call writes them), with
    plans of its own."""
    key_cache, value_cache = (cache.clone() for cache in caches)
    q, k, v = inputs
    fresh = replace(meta, plans=AttentionPlans())
    return get_backend("reference").forward(
        q, k, v, key_cache, value_cache, fresh, q.shape[-1] ** -0.5, **features)  # type: ignore[arg-type]


def decode_case(heads: int, kv_heads: int, block_size: int, dtype: torch.dtype, seed: int
                ) -> tuple[AttentionMetadata, tuple[torch.Tensor, torch.Tensor],
                           tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """A decode step of len(CACHED) requests whose blocks are scattered over a random cache."""
    gen = torch.Generator().manual_seed(seed)
    dim = 8
    needed = [-(-(c + 1) // block_size) for c in CACHED]
    num_blocks = sum(needed) + 3
    free = list(range(1, num_blocks))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in needed]
    caches = tuple(torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
                   for _ in range(2))
    batch = len(CACHED)
    inputs = (torch.randn(batch, heads, dim, generator=gen),
              torch.randn(batch, kv_heads, dim, generator=gen),
              torch.randn(batch, kv_heads, dim, generator=gen))
    meta = AttentionMetadata.build([1] * batch, CACHED, tables, block_size, torch.device("cpu"))
    return meta, caches, inputs  # type: ignore[return-value]


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times the reference backend took the compiled formulation (one per call)."""
    from pytgi_shard.attention import compiled_decode, reference

    taken: list[int] = []

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        taken.append(1)
        return compiled_decode.attend_decode(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(reference, "attend_decode", counted)
    return taken


FEATURES: dict[str, dict[str, object]] = {
    "plain": {},
    "window": {"sliding_window": 4},
    "softcap": {"softcap": 2.0},
    "alibi": {"alibi_slopes": torch.tensor([0.5, 0.25, 0.125, 0.0625])},
}


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_the_compiled_formulation_attends_as_the_reference_does(
    feature: str, heads: int, kv_heads: int, block_size: int, calls: list[int]
) -> None:
    meta, caches, inputs = decode_case(heads, kv_heads, block_size, torch.float32, seed=heads)
    expected = attend(meta, caches, inputs, **FEATURES[feature])
    assert not calls
    meta.compiled = True
    got = attend(meta, caches, inputs, **FEATURES[feature])
    assert calls == [1]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_an_fp8_cache_is_dequantized_as_it_is_read(calls: list[int]) -> None:
    meta, caches, inputs = decode_case(4, 2, 4, torch.float8_e4m3fn, seed=3)
    scales = KVScales.of(0.5, 0.25, torch.device("cpu"))
    expected = attend(meta, caches, inputs, kv_scales=scales)
    meta.compiled = True
    got = attend(meta, caches, inputs, kv_scales=scales)
    assert calls == [1]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_only_decode_steps_take_the_compiled_formulation(calls: list[int]) -> None:
    # A prefill (several new tokens) attends as before whatever the flag says: the formulation
    # is written for one query per request.
    gen = torch.Generator().manual_seed(0)
    cache = torch.zeros(4, 4, 1, 8)
    q, kv = torch.randn(3, 2, 8, generator=gen), torch.randn(3, 1, 8, generator=gen)
    meta = AttentionMetadata.build([3], [0], [[1]], 4, torch.device("cpu"))
    plain = get_backend("reference").forward(q, kv, kv, cache.clone(), cache.clone(),
                                             replace(meta, plans=AttentionPlans()), 0.35)
    meta.compiled = True
    flagged = get_backend("reference").forward(q, kv, kv, cache.clone(), cache.clone(), meta, 0.35)
    assert torch.equal(plain, flagged)
    assert not calls

"""The Llama-style decoder's other families against transformers, on one rank and on two.

Each family's tiny model (tests/tiny_models.DECODER_FAMILIES: transformers' own config class,
random weights, no download) runs through the paged cache as test_models.py runs Llama: prompts
across block boundaries and longer than any sliding window, a mixed step, decode steps; every
position's logits must equal transformers' full-sequence logits, on one rank and on each of two
ranks (one gloo spawn for all the families).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from pytgi_shard.distributed import init_distributed, single_process
from pytgi_shard.models import MODELS, ModelConfig, get_model
from pytgi_shard.models.llama import Llama
from tests.tiny_models import DECODER_FAMILIES, VOCAB_SIZE
from tests.unit.shard.test_models import (
    CPU,
    _free_port,
    assert_matches,
    hf_logits,
    paged_logits,
    sequences,
)

FAMILIES = list(DECODER_FAMILIES)


def test_every_family_is_registered() -> None:
    assert set(FAMILIES) <= set(MODELS)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_transformers(tiny_model: Callable[..., Path], family: str) -> None:
    path = tiny_model(family)
    model = get_model(ModelConfig.read(path), dtype=torch.float32, dist=single_process(CPU))
    assert isinstance(model, Llama) and model.model_type == family  # ours, not the fallback
    seqs = sequences(model.vocab_size)
    assert max(len(s) for s in seqs) > (DECODER_FAMILIES[family].get("sliding_window") or 0)
    assert_matches(paged_logits(model, seqs), hf_logits(path, seqs))


def _rank_main(rank: int, port: int, paths: list[Path], out_dir: Path) -> None:
    torch.set_num_threads(1)  # two ranks on a small CI machine: no oversubscription
    dist = init_distributed(rank, 2, "127.0.0.1", port, CPU)
    try:
        results = {}
        for path in paths:
            model = get_model(ModelConfig.read(path), dtype=torch.float32, dist=dist)
            results[path.name] = paged_logits(model, sequences(model.vocab_size))
        torch.save(results, out_dir / f"rank{rank}.pt")
    finally:
        dist.close()


def test_families_on_two_ranks_match_transformers(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    """world_size 2 over gloo: heads, MLP, vocabulary and per-head norms split; every rank's
    logits equal transformers'."""
    paths = [tiny_model(family) for family in FAMILIES]
    mp.spawn(_rank_main, args=(_free_port(), paths, tmp_path), nprocs=2, join=True)
    per_rank = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for path in paths:
        expected = hf_logits(path, sequences(VOCAB_SIZE))
        for rank, results in enumerate(per_rank):
            try:
                assert_matches(results[path.name], expected)
            except AssertionError as e:
                raise AssertionError(f"{path.name} on rank {rank}: {e}") from e

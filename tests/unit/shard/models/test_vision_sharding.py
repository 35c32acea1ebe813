"""Vision towers split over tensor-parallel ranks as the decoder (models/vision_sharding.py):
on two gloo ranks (one process each) every tower -- Qwen2-VL's, Qwen2.5-VL's windowed one,
CLIP (LLaVA-NeXT), SigLIP (PaliGemma) and Idefics3's SigLIP -- holds half of its heads and MLP
per rank and gives one rank's output (which tests/unit/shard/models/*/test_vision.py and the
families' encode tests hold equal to transformers'); a head count the ranks do not divide
replicates the tower, with one log line."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from pytgi_shard.device.distributed import Dist, init_distributed, single_process
from pytgi_shard.layers.linear import ColumnParallelLinear, RowParallelLinear
from pytgi_shard.models import ModelConfig
from pytgi_shard.models.clip.vision import ClipVisionConfig, ClipVisionTower, clip_prefix
from pytgi_shard.models.idefics3.model import Idefics3Tower
from pytgi_shard.models.qwen2_vl.vision import VisionConfig, VisionTower
from pytgi_shard.models.siglip.vision import SiglipConfig, SiglipVisionTower, siglip_prefix
from pytgi_shard.models.vision_sharding import replication_reason, tower_weights
from pytgi_shard.quantization.linear_format import DENSE
from pytgi_shard.weights.reader import Weights
from tests.siglip_models import write_paligemma_model
from tests.unit.shard.models.test_models import _free_port
from tests.vision_models import write_llava_next_model, write_qwen2_vl_model

CPU = torch.device("cpu")
TOWERS = ("qwen2_vl", "qwen2_5_vl", "clip", "siglip", "idefics3")


def _build(tower: str, path: Path, dist: Dist) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    """`tower` loaded from the checkpoint at `path` on `dist`, and a run of it on fixed random
    pixels (the same on every rank)."""
    raw = ModelConfig.read(path).raw
    weights = Weights(path, torch.float32, dist)
    gen = torch.Generator().manual_seed(7)
    if tower in ("qwen2_vl", "qwen2_5_vl"):
        config = VisionConfig(raw["vision_config"], windowed=tower == "qwen2_5_vl")
        qwen = VisionTower(weights, "visual", config)
        grid = (1, 8, 12)  # 2 x 3 Qwen2.5-VL windows, edge ones included
        pixels = torch.randn(8 * 12, qwen.patch_dim, generator=gen)
        return qwen, lambda: qwen(pixels, grid)
    if tower == "clip":
        clip_config = ClipVisionConfig.from_dict(raw["vision_config"])
        clip = ClipVisionTower(weights, clip_prefix(weights, "vision_tower"), clip_config,
                               clip_config.layers_for(-2))
        s = clip_config.image_size
        tiles = torch.randn(3, clip_config.num_channels, s, s, generator=gen)
        return clip, lambda: clip(tiles)
    siglip_config = SiglipConfig.from_dict(raw["vision_config"])
    kind = Idefics3Tower if tower == "idefics3" else SiglipVisionTower
    siglip = kind(weights, siglip_prefix(weights, "vision_tower"), siglip_config)
    patches = torch.randn(siglip_config.num_patches, siglip_config.patch_dim, generator=gen)
    return siglip, lambda: siglip(patches)


def _held(module: nn.Module) -> int:
    """Parameters of the tower's parallel linears on this rank (what the split applies to)."""
    linears = (ColumnParallelLinear, RowParallelLinear)
    return sum(p.numel() for m in module.modules() if isinstance(m, linears)
               for p in m.parameters())


def _rank_main(rank: int, port: int, paths: dict[str, Path], out: Path) -> None:
    torch.set_num_threads(1)  # two ranks on a small machine: no oversubscription
    dist = init_distributed(rank, 2, "127.0.0.1", port, CPU)
    try:
        results = {}
        for tower in TOWERS:
            module, run = _build(tower, paths[tower], dist)
            results[tower] = (run(), _held(module))
        torch.save(results, out / f"rank{rank}.pt")
    finally:
        dist.close()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    qwen2 = write_qwen2_vl_model(tmp_path_factory.mktemp("qwen2_vl"))
    qwen25 = write_qwen2_vl_model(tmp_path_factory.mktemp("qwen2_5_vl"), family="qwen2_5_vl")
    llava = write_llava_next_model(tmp_path_factory.mktemp("llava_next"))
    paligemma = write_paligemma_model(tmp_path_factory.mktemp("paligemma"))
    return {"qwen2_vl": qwen2, "qwen2_5_vl": qwen25, "clip": llava, "siglip": paligemma,
            "idefics3": paligemma}


def test_two_ranks_split_every_tower_and_give_one_ranks_output(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    mp.spawn(_rank_main, args=(_free_port(), checkpoints, tmp_path), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for tower in TOWERS:
        module, run = _build(tower, checkpoints[tower], single_process(CPU))
        expected, whole = run(), _held(module)
        for got, held in (r[tower] for r in ranks):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=tower)
            # Split, not replicated: each rank holds about half of the tower's linears (rank 0
            # the row-parallel biases too), the two together exactly all of them.
            assert held <= 0.55 * whole, tower
        assert sum(r[tower][1] for r in ranks) == whole, tower


def test_replication_reason_names_what_does_not_split() -> None:
    assert replication_reason(16, [4304], 1) is None
    assert replication_reason(16, [4304], 4) is None
    assert "3 attention heads" in str(replication_reason(3, [48], 2))
    assert "4303-wide MLP" in str(replication_reason(16, [4096, 4303], 2))


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tower_the_ranks_cannot_split_is_replicated_with_one_log_line(
    checkpoints: dict[str, Path], rank: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Three heads over two ranks: every rank reads the tower whole, as one rank (no
    collective: the world of its view is one), in float; only rank 0 logs why."""
    weights = Weights(checkpoints["siglip"], torch.float32, Dist(rank, 2, CPU, None))
    with caplog.at_level(logging.INFO, logger="pytgi_shard.models.vision_sharding"):
        view = tower_weights(weights, "SigLIP", 3, [48])
        split = tower_weights(weights, "SigLIP", 2, [48])
    assert (view.dist.world_size, view.dist.rank, view.linear_format) == (1, 0, DENSE)
    assert (split.dist.world_size, split.dist.rank) == (2, rank)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == (["SigLIP vision tower: replicated on each of the 2 ranks, not split: its 3 "
                      "attention heads do not split over 2 ranks"] if rank == 0 else [])

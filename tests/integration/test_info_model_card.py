"""/info's `model_sha` and `model_pipeline_tag` (issue 11, item 12) over HTTP, for a model served
from a Hugging Face cache snapshot as the launcher resolves it: `models--org--name/snapshots/
<commit>/` whose files link into `blobs/`, exactly as huggingface_hub lays it out."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx

from tests.router_process import RouterProcess
from tests.shard_process import start_shards

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_snapshot(model: Path, cache: Path) -> Path:
    repo = cache / "models--pytgi--tiny-llama"
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for i, source in enumerate(sorted(p for p in model.iterdir() if p.is_file())):
        blob = repo / "blobs" / f"blob{i}"
        blob.write_bytes(source.read_bytes())
        (snapshot / source.name).symlink_to(Path("..", "..", "blobs", blob.name))
    return snapshot


def test_info_names_the_resolved_revision_and_the_pipeline(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    model = tiny_model("llama")
    snapshot = hub_snapshot(model, tmp_path / "hub")
    with start_shards(snapshot) as shards:
        with RouterProcess(shards.urls[0], snapshot) as router:
            info = httpx.get(f"{router.url}/info", timeout=30).json()
        assert info["model_sha"] == COMMIT
        assert info["model_pipeline_tag"] == "text-generation"
        # A plain directory has no resolved revision to report.
        with RouterProcess(shards.urls[0], model) as router:
            info = httpx.get(f"{router.url}/info", timeout=30).json()
        assert info["model_sha"] is None
        assert info["model_pipeline_tag"] == "text-generation"

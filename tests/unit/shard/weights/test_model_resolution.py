"""Model resolution: local folders, Hub snapshots from huggingface_hub's cache, `.bin` conversion."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pytgi_shard.weights.conversion import safetensors_name
from pytgi_shard.weights.resolution import ModelNotFound, WeightsSource, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


def hub_cache(root: Path, repo_id: str, files: Path, commit: str = COMMIT, ref: str = "main") -> Path:
    """A huggingface_hub cache holding `files` as snapshot `commit` of `repo_id` at `ref`, laid out
    as the library lays it out (blobs, snapshot links, refs)."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in files.iterdir():
        blob = repo / "blobs" / f"{commit[:8]}-{f.name}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


def bin_model(tiny_model: Callable[..., Path], dest: Path, shards: int = 1) -> Path:
    """The tiny llama re-saved the pre-safetensors way: pytorch_model.bin, or `shards` files
    with a pytorch_model.bin.index.json (written by hand: transformers 5 saves only
    safetensors)."""
    src = tiny_model("llama")
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("*.safetensors*"))
    state = load_file(str(src / "model.safetensors"))
    if shards == 1:
        torch.save(state, dest / "pytorch_model.bin")
        return dest
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = names[i::shards]
        torch.save({n: state[n] for n in part}, dest / file)
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (dest / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    return dest


def test_local_directory_is_used_as_is(tiny_model: Callable[..., Path]) -> None:
    path = tiny_model("llama")
    assert resolve_model(WeightsSource(str(path))) == path


def test_missing_local_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="does not exist"):
        resolve_model(WeightsSource(str(tmp_path / "nope")))


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="has no config.json"):
        resolve_model(WeightsSource(str(tmp_path)))


def test_directory_without_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFound, match="no \\*.safetensors"):
        resolve_model(WeightsSource(str(tmp_path)))


def test_bin_is_converted_once_and_equal(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    path = bin_model(tiny_model, tmp_path / "m")
    reference = torch.load(path / "pytorch_model.bin", weights_only=True)
    assert resolve_model(WeightsSource(str(path))) == path
    converted = load_file(path / "model.safetensors")
    assert converted.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(converted[name], tensor), name
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    resolve_model(WeightsSource(str(path)))
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp


def test_sharded_bin_gets_a_safetensors_index(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    path = bin_model(tiny_model, tmp_path / "m", shards=6)
    bins = sorted(path.glob("pytorch_model-*.bin"))
    assert len(bins) > 1
    resolve_model(WeightsSource(str(path)))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert files == {safetensors_name(b.name) for b in bins}
    assert all((path / f).is_file() for f in files)
    from transformers import AutoModelForCausalLM

    # transformers itself loads the converted folder once the .bin files are gone.
    for b in bins:
        b.unlink()
    (path / "pytorch_model.bin.index.json").unlink()
    AutoModelForCausalLM.from_pretrained(path)


class _Exploit:
    def __reduce__(self) -> tuple[object, tuple[str, ...]]:
        return (os.system, ("touch PWNED",))


def test_bin_with_code_in_its_pickle_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    # A zip-format torch checkpoint whose pickle calls os.system when unpickled unsafely.
    torch.save({"weight": torch.zeros(2), "payload": _Exploit()}, tmp_path / "pytorch_model.bin",
               pickle_module=pickle)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(ModelNotFound, match="cannot load .* safely"):
            resolve_model(WeightsSource(str(tmp_path)))
    finally:
        os.chdir(cwd)
    assert not (tmp_path / "PWNED").exists()
    assert not list(tmp_path.glob("*.safetensors"))


def test_hub_id_resolves_from_the_cache_offline(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    cache = tmp_path / "hub"
    snapshot = hub_cache(cache, "pytgi-test/tiny-llama", tiny_model("llama"))
    source = WeightsSource("pytgi-test/tiny-llama", huggingface_hub_cache=str(cache), offline=True)
    assert resolve_model(source) == snapshot


def test_hub_revision_picks_its_snapshot(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    cache = tmp_path / "hub"
    hub_cache(cache, "pytgi-test/tiny", tiny_model("llama"))
    other = hub_cache(cache, "pytgi-test/tiny", tiny_model("mistral"), OTHER_COMMIT, ref="v2")
    source = WeightsSource("pytgi-test/tiny", revision="v2", huggingface_hub_cache=str(cache),
                           offline=True)
    assert resolve_model(source) == other


def test_hub_snapshot_with_only_bin_is_converted(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    cache = tmp_path / "hub"
    files = bin_model(tiny_model, tmp_path / "files")
    snapshot = hub_cache(cache, "pytgi-test/old-style", files)
    source = WeightsSource("pytgi-test/old-style", huggingface_hub_cache=str(cache), offline=True)
    assert resolve_model(source) == snapshot
    assert (snapshot / "model.safetensors").is_file()


def test_offline_without_cached_copy_names_model_and_cache(tmp_path: Path) -> None:
    cache = tmp_path / "empty-cache"
    source = WeightsSource("pytgi-test/absent", huggingface_hub_cache=str(cache), offline=True)
    with pytest.raises(ModelNotFound) as exc:
        resolve_model(source)
    message = str(exc.value)
    assert "pytgi-test/absent" in message and str(cache) in message and "\n" not in message


def test_launcher_exits_with_one_error_line_when_offline_and_uncached(tmp_path: Path) -> None:
    cache = tmp_path / "empty-cache"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pytgi_launcher.cli", "--model-id", "pytgi-test/absent",
         "--huggingface-hub-cache", str(cache)],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "pytgi-test/absent" in lines[0] and str(cache) in lines[0]
    assert lines[0].startswith("pytgi-launcher: error:")


def download_weights(*args: str) -> subprocess.CompletedProcess[str]:
    script = str(Path(sys.executable).with_name("pytgi-shard"))
    return subprocess.run([script, "download-weights", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_download_weights_command_prints_the_snapshot(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    cache = tmp_path / "hub"
    snapshot = hub_cache(cache, "pytgi-test/tiny-llama", tiny_model("llama"))
    done = download_weights("pytgi-test/tiny-llama", "--huggingface-hub-cache", str(cache))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(snapshot)


def test_metadata_only_needs_no_weights(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    files = tmp_path / "files"
    shutil.copytree(tiny_model("llama"), files, ignore=shutil.ignore_patterns("*.safetensors"))
    cache = tmp_path / "hub"
    snapshot = hub_cache(cache, "pytgi-test/tokenizer-only", files)
    done = download_weights("pytgi-test/tokenizer-only", "--metadata-only",
                            "--huggingface-hub-cache", str(cache))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(snapshot)
    done = download_weights("pytgi-test/tokenizer-only", "--huggingface-hub-cache", str(cache))
    assert done.returncode == 1
    assert "holds no *.safetensors or pytorch_model*.bin weights" in done.stderr


def test_hub_token_accepts_tgis_older_variable() -> None:
    from pytgi_shard.weights.resolution import hub_token

    assert hub_token({"HF_TOKEN": "a", "HF_API_TOKEN": "b"}) == "a"
    assert hub_token({"HF_API_TOKEN": "b"}) == "b"
    assert hub_token({"HF_TOKEN": ""}) is None

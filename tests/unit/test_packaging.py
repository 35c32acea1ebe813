"""The distribution ships every package folder under its pytgi_* import name, except the
benchmarks' repository-only parts."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"proto": "pytgi_proto", "router": "pytgi_router", "shard": "pytgi_shard",
           "launcher": "pytgi_launcher", "bench": "pytgi_bench"}
# bench/compare (`make bench`, bench/gpu.sh) and bench/experiments measure pytgi in this
# repository; users get only the load tool, pytgi_bench's top level. The editable install
# (`make install`, gpu.sh's `pip install -e .`) still imports them: setuptools maps each
# top-level package to its folder and Python finds subpackages there, listed or not.
REPOSITORY_ONLY = {"pytgi_bench.compare", "pytgi_bench.experiments"}


def _is_repository_only(dotted: str) -> bool:
    return any(dotted == r or dotted.startswith(r + ".") for r in REPOSITORY_ONLY)


def test_every_package_folder_is_listed_but_the_repository_only_ones() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    for folder, name in FOLDERS.items():
        assert setuptools["package-dir"][name] == folder
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            dotted = ".".join([name, *rel.parts])
            if _is_repository_only(dotted):
                assert dotted not in listed, f"{dotted} is repository-only: not for the wheel"
            else:
                assert dotted in listed, f"{init.parent} is not in pyproject's packages list"


def test_the_wheel_ships_the_load_tool_and_not_the_comparisons_or_experiments(
    tmp_path: Path,
) -> None:
    """Built from a copy of the package folders (setuptools writes build/ beside pyproject)."""
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "results", "*.png")
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, src / folder, ignore=skip)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", str(src), "-w", str(tmp_path / "wheel")],
                   check=True, capture_output=True, timeout=240)
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    bench = {n for n in names if n.startswith("pytgi_bench/")}
    assert {"pytgi_bench/cli.py", "pytgi_bench/load.py", "pytgi_bench/requirements_check.py",
            "pytgi_bench/shard_cli.py"} <= bench
    assert not [n for n in bench if n.startswith(("pytgi_bench/compare/",
                                                  "pytgi_bench/experiments/"))]
    # Compiled where the shard runs (shard/lora/cpu_kernel.py): its source must ship.
    assert "pytgi_shard/lora/cpu_lora.cpp" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "pytgi-benchmark = pytgi_bench.cli:main" in zipfile.ZipFile(wheel).read(
        entry_points).decode()


def test_no_generic_top_level_names() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert all(p.startswith("pytgi_") for p in setuptools["packages"])


def test_torch_is_a_range_for_users_and_pinned_only_for_these_machines() -> None:
    """`pip install '.[cuda]'` keeps a CUDA torch already installed: the package asks for a range.
    The CPU build CI and development use is pinned in constraints.txt, which `make install`
    passes, so they never download a multi-GB CUDA build."""
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (torch,) = [r for r in map(Requirement, project["dependencies"]) if r.name == "torch"]
    assert all(s.operator != "==" for s in torch.specifier), f"{torch} pins an exact build"
    assert torch.specifier.contains("2.11.0"), "the GPU machine's CUDA torch must satisfy it"
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    (pin,) = [Requirement(line) for line in lines if line.startswith("torch")]
    (exact,) = pin.specifier
    assert exact.operator == "==" and torch.specifier.contains(exact.version)
    assert "-c constraints.txt" in (ROOT / "Makefile").read_text()


def test_jinja2_has_the_sandbox_escape_fixes() -> None:
    """Chat templates run in jinja2's sandbox; 3.1.5 and 3.1.6 fixed escapes from it
    (CVE-2024-56201, CVE-2024-56326, CVE-2025-27516): older versions must not satisfy the range."""
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (jinja2,) = [r for r in map(Requirement, project["dependencies"]) if r.name == "jinja2"]
    assert not jinja2.specifier.contains("3.1.5") and jinja2.specifier.contains("3.1.6")

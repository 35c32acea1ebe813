"""The distribution ships every package folder under its pytgi_* import name."""

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"proto": "pytgi_proto", "router": "pytgi_router", "shard": "pytgi_shard",
           "launcher": "pytgi_launcher", "bench": "pytgi_bench"}


def test_every_package_folder_is_listed() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    for folder, name in FOLDERS.items():
        assert setuptools["package-dir"][name] == folder
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            dotted = ".".join([name, *rel.parts])
            assert dotted in listed, f"{init.parent} is not in pyproject's packages list"


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

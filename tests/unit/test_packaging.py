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

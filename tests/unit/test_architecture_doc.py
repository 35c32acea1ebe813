"""ARCHITECTURE.md names files and functions (`router/core/infer.py: Infer.submit`); a rename that
forgets the map fails here, so the map stays true."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "ARCHITECTURE.md"
# `some/file.py: Name` or `some/file.py: Class.method`, possibly "→"-chained inside one span.
REFERENCE = re.compile(r"`([\w/]+\.py): ([\w.]+)`")
FOLDERS = ("proto", "router", "shard", "launcher")


def defined_names(path: Path) -> set[str]:
    """Top-level functions and classes of `path`, and Class.method for their methods."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        if isinstance(node, ast.ClassDef):
            out.update(
                f"{node.name}.{item.name}"
                for item in node.body
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
            )
    return out


def resolve(relative: str) -> Path:
    """A path as the map writes it: from the repository root, or within a package folder
    (`core/queue.py` is router/core/queue.py, `batch.py` after a `shard/...` reference)."""
    direct = ROOT / relative
    if direct.is_file():
        return direct
    candidates = [ROOT / f / relative for f in FOLDERS if (ROOT / f / relative).is_file()]
    assert len(candidates) == 1, f"ARCHITECTURE.md names {relative}: found {candidates}"
    return candidates[0]


def test_every_function_the_map_names_exists() -> None:
    references = REFERENCE.findall(DOC.read_text(encoding="utf-8"))
    assert len(references) > 10, "the request path lost its file:function references"
    missing = [
        f"{file}: {name}" for file, name in references
        if name not in defined_names(resolve(file))
    ]
    assert not missing, f"ARCHITECTURE.md names what the code no longer has: {missing}"


def test_every_file_the_map_names_exists() -> None:
    files = set(re.findall(r"`((?:proto|router|shard|launcher)/[\w/]+\.py)", DOC.read_text()))
    assert files
    assert not [f for f in files if not (ROOT / f).is_file()]

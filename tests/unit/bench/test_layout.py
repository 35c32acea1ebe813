"""pytgi_bench's three parts import one way: experiments -> compare -> the load tool.

The wheel ships only the load tool (pytgi_bench's top level; tests/unit/test_packaging.py), so
an import of pytgi_bench.compare or pytgi_bench.experiments from it would break
`pytgi-benchmark` for every user while passing in this repository's editable install. Read from
the source, every import counted (lazy ones too).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"
# What each part may import of pytgi_bench.
PARTS = {
    "load tool": ("", {""}),
    "compare": ("compare", {"", "compare"}),
    "experiments": ("experiments", {"", "compare", "experiments"}),
}


def _part_of(module: str) -> str:
    """'' for the load tool, else the subpackage: pytgi_bench.compare.run -> 'compare'."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ("compare", "experiments"):
        return parts[1]
    return ""


def _bench_imports(path: Path) -> list[tuple[int, str]]:
    """Every pytgi_bench module `path` imports, with its line (the bench uses absolute imports)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level:
            found.append((node.lineno, "<relative>"))
    return [(line, m) for line, m in found
            if m == "<relative>" or m.split(".")[0] == "pytgi_bench"]


@pytest.mark.parametrize("part", sorted(PARTS))
def test_imports_go_one_way(part: str) -> None:
    folder, allowed = PARTS[part]
    files = sorted((BENCH / folder).glob("*.py"))
    assert files
    bad = [f"{path.relative_to(BENCH)}:{line} imports {target}"
           for path in files for line, target in _bench_imports(path)
           if target == "<relative>" or _part_of(target) not in allowed]
    assert bad == []


def test_every_module_belongs_to_a_part() -> None:
    """A new bench module goes in one of the three folders, not a fourth one."""
    folders = {p.name for p in BENCH.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == {"compare", "experiments"}

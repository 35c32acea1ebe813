"""The import graph between pytgi's packages, read from the source (parsed, never imported).

The processes share only the protocol: launcher → {shard, router} → proto, never sideways. The
router runs without torch (it serves HTTP and schedules; the shards compute), and inside the
router the serving engine (pytgi_router.core) knows nothing of the web front (pytgi_router.http)
that builds on it. The benchmark and the tests use the packages; no package uses them.

Every import counts: top-level, inside a function (a lazy import is still a dependency), under
TYPE_CHECKING (a type-only import still couples the packages), relative ones resolved.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"proto": "pytgi_proto", "router": "pytgi_router", "shard": "pytgi_shard",
            "launcher": "pytgi_launcher"}
OURS = {*PACKAGES.values(), "pytgi_bench", "tests"}
# The shards' machinery: the router must start (and be installable) without it.
HEAVY = {"torch", "triton", "transformers"}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted
    target: str  # the imported module, dotted and absolute
    where: str  # file:line

    def __str__(self) -> str:
        return f"{self.where}: {self.module} imports {self.target}"


def module_name(path: Path) -> tuple[str, bool]:
    """The dotted import name of `path`, and whether it is a package's __init__."""
    folder, *rest = path.relative_to(ROOT).with_suffix("").parts
    is_package = rest[-1] == "__init__"
    parts = [PACKAGES[folder], *(rest[:-1] if is_package else rest)]
    return ".".join(parts), is_package


def absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module `from ... import` reads from, relative levels resolved against `module`."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports_of(path: Path) -> Iterator[Import]:
    module, is_package = module_name(path)
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, alias.name, where)
        elif isinstance(node, ast.ImportFrom):
            source = absolute(node, module, is_package)
            for alias in node.names:
                # `from pytgi_router import server` (or `from . import x`) imports a module.
                named = "." not in source or node.module is None
                yield Import(module, f"{source}.{alias.name}" if named else source, where)


def all_imports() -> list[Import]:
    return [imp for folder in PACKAGES for path in sorted((ROOT / folder).rglob("*.py"))
            for imp in imports_of(path)]


IMPORTS = all_imports()


def top(name: str) -> str:
    return name.split(".")[0]


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def violations(importer: str, allowed: set[str]) -> list[str]:
    """Imports of our packages by `importer`'s modules that are not in `allowed`."""
    return [str(imp) for imp in IMPORTS if within(imp.module, importer)
            and top(imp.target) in OURS and top(imp.target) not in allowed]


def test_the_walk_sees_every_package_and_their_imports() -> None:
    """The checks below cannot pass vacuously: the walk found the known edges."""
    edges = {(top(i.module), top(i.target)) for i in IMPORTS}
    for edge in [("pytgi_router", "pytgi_proto"), ("pytgi_shard", "pytgi_proto"),
                 ("pytgi_launcher", "pytgi_shard")]:
        assert edge in edges
    core_edges = [i for i in IMPORTS if within(i.module, "pytgi_router.http")
                  and within(i.target, "pytgi_router.core")]
    assert core_edges, "the web front is expected to build on the serving engine"


def test_the_protocol_imports_no_other_pytgi_package() -> None:
    assert violations("pytgi_proto", {"pytgi_proto"}) == []


def test_the_router_imports_only_the_protocol_and_itself() -> None:
    assert violations("pytgi_router", {"pytgi_proto", "pytgi_router"}) == []


def test_the_router_never_imports_the_shards_machinery() -> None:
    heavy = [str(i) for i in IMPORTS if within(i.module, "pytgi_router") and top(i.target) in HEAVY]
    assert heavy == []


def test_the_serving_engine_never_imports_the_web_front() -> None:
    """pytgi_router.core is below pytgi_router.http, and below the process level (cli, server,
    settings), which builds both."""
    above = ("pytgi_router.http", "pytgi_router.server", "pytgi_router.cli",
             "pytgi_router.settings")
    upward = [str(i) for i in IMPORTS if within(i.module, "pytgi_router.core")
              and any(within(i.target, a) for a in above)]
    assert upward == []


def test_the_shard_imports_only_the_protocol_and_itself() -> None:
    """Target state of issue 12: the shard's own subcommands (ctl, download-weights) live in
    pytgi_shard, so nothing of pytgi_launcher is imported by it."""
    assert violations("pytgi_shard", {"pytgi_proto", "pytgi_shard"}) == []


def test_the_launcher_imports_the_processes_it_starts_and_the_protocol() -> None:
    allowed = {"pytgi_launcher", "pytgi_shard", "pytgi_router", "pytgi_proto"}
    assert violations("pytgi_launcher", allowed) == []


@pytest.mark.parametrize("user", sorted(PACKAGES.values()))
def test_no_package_imports_the_benchmark_or_the_tests(user: str) -> None:
    found = [str(i) for i in IMPORTS if within(i.module, user)
             and top(i.target) in {"pytgi_bench", "tests"}]
    assert found == []


def test_relative_imports_resolve_inside_their_package() -> None:
    """The resolution the checks rely on: `from ..x import y` in a subpackage."""
    node = ast.parse("from ..http import app").body[0]
    assert isinstance(node, ast.ImportFrom)
    assert absolute(node, "pytgi_router.core.infer", False) == "pytgi_router.http"
    assert absolute(node, "pytgi_router.core", True) == "pytgi_router.http"


# The shard's folders, each allowed to import only those below it: the process (service) builds
# the engine, the engine runs the model and chooses, emits and constrains tokens, the model is
# built from layers over attention, weights and the device. A folder importing one above it (or
# sideways, between the step's helpers) is a cycle in the making.
SHARD_BELOW = {
    "service": {"engine", "models", "weights", "device", "attention", "quantization", "output",
                "sample", "structured_output", "layers", "lora"},
    "engine": {"models", "layers", "attention", "weights", "quantization", "device", "output",
               "sample", "structured_output", "speculative", "lora"},
    "lora": {"models", "layers", "weights", "quantization", "device"},
    "speculative": {"sample", "device"},
    "sample": {"structured_output", "device"},
    "structured_output": {"device"},
    "output": {"device"},
    "models": {"layers", "attention", "weights", "quantization", "device"},
    "layers": {"attention", "weights", "quantization", "device"},
    "quantization": {"attention", "device"},
    "weights": {"quantization", "device"},
    "attention": {"device"},
    "device": set(),
}


def shard_folder(module: str) -> str | None:
    """The folder of pytgi_shard a module lives in; None for the package's top-level modules
    (settings, errors), which every folder may import."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[1] in SHARD_BELOW else None


def test_every_shard_folder_is_in_the_layering() -> None:
    folders = {p.name for p in (ROOT / "shard").iterdir() if (p / "__init__.py").is_file()}
    assert folders == set(SHARD_BELOW)


def test_shard_folders_import_only_the_folders_below_them() -> None:
    upward = []
    for imp in IMPORTS:
        source, target = shard_folder(imp.module), shard_folder(imp.target)
        if source and target and source != target and target not in SHARD_BELOW[source]:
            upward.append(str(imp))
    assert upward == []

"""The two environments `make test` builds: the main one on the releases constraints.txt pins (the
whole suite), the lowest on the lowest releases pyproject.toml allows (LOWEST_TESTS). Each check
here stops a quiet drift: a raised lower bound the lowest run would no longer test, a test client
that would cap huggingface-hub (and with it transformers) again, a renamed test file."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def pins(name: str) -> dict[str, Version]:
    """The exact pins of a constraints file, by canonical name."""
    out: dict[str, Version] = {}
    for line in (ROOT / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        requirement = Requirement(line)
        (spec,) = requirement.specifier
        assert spec.operator == "==", f"{name}: {line} is not an exact pin"
        out[canonicalize_name(requirement.name)] = Version(spec.version)
    return out


def project() -> dict[str, Requirement]:
    """pyproject.toml's runtime requirements, by canonical name."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {canonicalize_name(r.name): r for r in map(Requirement, deps)}


def make_variable(name: str) -> str:
    """A variable of the Makefile, its continuation lines joined."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    match = re.search(rf"^{name} :=(.*)$", text, re.M)
    assert match, f"the Makefile defines no {name}"
    return match.group(1).strip()


def test_the_lowest_pins_are_pyprojects_lower_bounds() -> None:
    requirements = project()
    lowest = pins("constraints-lowest.txt")
    assert {"transformers", "huggingface-hub", "tokenizers"} <= set(lowest)
    for name, version in lowest.items():
        if name == "torch":
            continue
        floors = [Version(s.version) for s in requirements[name].specifier if s.operator == ">="]
        assert floors == [version], f"{name}: pyproject says {requirements[name]}, pinned {version}"


def test_both_environments_pin_one_torch_and_the_main_pins_fit_pyproject() -> None:
    main, lowest = pins("constraints.txt"), pins("constraints-lowest.txt")
    assert main["torch"] == lowest["torch"]
    requirements = project()
    for name, version in main.items():
        assert requirements[name].specifier.contains(version), f"{name}=={version}"
    assert main["transformers"].major == 5, "the main run is on the release users get"


def test_no_extra_caps_the_hub_and_the_tgi_client_is_installed_apart() -> None:
    """text-generation asks for huggingface-hub<1, which transformers 5 cannot use: resolved with
    the extras it held the whole install at transformers 4.57."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {canonicalize_name(Requirement(r).name) for group in extras.values() for r in group}
    assert "text-generation" not in names
    assert make_variable("TGI_CLIENT").startswith("text-generation==")
    assert {"aiohttp", "pydantic", "requests"} <= names, "the client's own dependencies"


def test_the_lowest_run_selects_files_that_exist() -> None:
    from tests.conftest import TRANSFORMERS_STACK_FILES

    assert "-m transformers_stack" in make_variable("LOWEST_TESTS")
    names = {path.name for path in (ROOT / "tests").rglob("test_*.py")}
    assert len(TRANSFORMERS_STACK_FILES) >= 10
    missing = TRANSFORMERS_STACK_FILES - names
    assert not missing, missing

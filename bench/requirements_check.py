"""Does this environment hold everything pytgi and its test clients need?

    python -m pytgi_bench.requirements_check [ROOT ...] [--json PATH]

Walks the requirements of each root distribution (default: pytgi and the test clients) and of
everything they need, as installed — importlib.metadata, so a PYTHONPATH directory filled by
`pip install --target` counts — and prints what is missing or installed at a version outside the
range asked for. bench/gpu.sh runs it after installing the wheels of bench/gpu-wheels.txt with
--no-deps on a machine without network: nothing resolved the dependencies there, so this is
where a wheel missing from the list shows up, by name, before a test or a server fails on an
import.

`--trust NAMES` stops the walk at distributions the machine brings (its CUDA torch, triton,
transformers): they are checked for presence and range, but how they were installed and what
they need is the machine's business — a torch built into an image may not list its CUDA
libraries as installed distributions, and that is no fault of this install.

Exit 1 when a distribution is missing (an import would fail). A version outside a range is only
a warning: the GPU machine's own torch, transformers and huggingface-hub are newer than some
clients ask for (text-generation wants huggingface-hub<1.0), and replacing them is not an option.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

DEFAULT_ROOTS = ("pytgi", "pytest-timeout", "openai", "text-generation")

# name -> installed version (None when absent); name -> its requirement strings.
VersionOf = Callable[[str], str | None]
RequiresOf = Callable[[str], list[str]]


@dataclass(frozen=True, slots=True)
class Problem:
    name: str
    # "missing", or the installed version that is outside `wanted`.
    found: str
    wanted: str
    needed_by: str


@dataclass(slots=True)
class CheckReport:
    checked: list[str] = field(default_factory=list)
    missing: list[Problem] = field(default_factory=list)
    outside_range: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.missing

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_requires(name: str) -> list[str]:
    try:
        return list(importlib.metadata.requires(name) or [])
    except importlib.metadata.PackageNotFoundError:
        return []


def _applies(requirement: Requirement, extras: Iterable[str]) -> bool:
    """Whether the requirement holds here for a distribution installed with `extras`."""
    if requirement.marker is None:
        return True
    # evaluate() fills in this interpreter's environment around the extra.
    return any(requirement.marker.evaluate({"extra": extra}) for extra in ("", *extras))


def _in_range(version: str, requirement: Requirement) -> bool:
    try:
        return requirement.specifier.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return True  # a local build string we cannot order: trust it


def check(
    roots: Iterable[str],
    version_of: VersionOf = installed_version,
    requires_of: RequiresOf = installed_requires,
    trusted: Iterable[str] = (),
) -> CheckReport:
    """Every distribution reachable from `roots` through installed requirements, checked once.

    A root may carry extras (`pytgi[test]`); a requirement reached twice is checked against each
    range that asks for it, so a conflict names every distribution that wants something else.
    The requirements of `trusted` distributions are not walked.
    """
    report = CheckReport()
    trust = {canonicalize_name(n) for n in trusted}
    pending: list[tuple[Requirement, str]] = [(Requirement(root), "(asked for)") for root in roots]
    extras_seen: dict[str, set[str]] = {}
    while pending:
        requirement, needed_by = pending.pop(0)
        name = canonicalize_name(requirement.name)
        version = version_of(name)
        wanted = str(requirement.specifier) or "any version"
        if version is None:
            if all(p.name != name for p in report.missing):
                report.missing.append(Problem(name, "missing", wanted, needed_by))
            continue
        if requirement.specifier and not _in_range(version, requirement):
            report.outside_range.append(Problem(name, version, wanted, needed_by))
        known = extras_seen.get(name)
        new_extras = set(requirement.extras) - (known or set())
        if known is not None and not new_extras:
            continue
        extras_seen[name] = (known or set()) | set(requirement.extras)
        if known is None:
            report.checked.append(f"{name}=={version}")
        for text in [] if name in trust else requires_of(name):
            try:
                child = Requirement(text)
            except InvalidRequirement:
                continue
            if _applies(child, extras_seen[name]):
                pending.append((child, f"{name} {version}"))
    report.checked.sort()
    return report


def print_report(report: CheckReport, out: object = sys.stdout) -> None:
    write = out.write  # type: ignore[attr-defined]
    write(f"requirements: {len(report.checked)} distributions present\n")
    for p in report.missing:
        write(f"MISSING  {p.name} ({p.wanted}), needed by {p.needed_by}\n")
    for p in report.outside_range:
        write(f"warning  {p.name} {p.found} is outside {p.wanted}, asked by {p.needed_by}\n")
    if report.ok:
        write("requirements: nothing missing\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pytgi_bench.requirements_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("roots", nargs="*", default=list(DEFAULT_ROOTS))
    p.add_argument("--trust", nargs="+", default=[],
                   help="distributions whose own requirements are not walked")
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = p.parse_args(argv)
    report = check(args.roots, trusted=args.trust)
    print_report(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report.to_json(), indent=2))
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""`--version` / `-V` of the three commands: one line, `pytgi <version>`, as TGI's binaries print
`text-generation-launcher <version>`.

Here because all three CLIs share it and each may import only pytgi_proto; the standard library
only, so asking for the version loads nothing heavy.
"""

from __future__ import annotations

import argparse
from importlib import metadata

DISTRIBUTION = "pytgi"


def package_version() -> str:
    """The installed distribution's version; "0.0.0" when run from a tree that was never
    installed (nothing to read it from)."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "0.0.0"


def version_line() -> str:
    return f"{DISTRIBUTION} {package_version()}"


def add_version_flag(parser: argparse.ArgumentParser) -> None:
    """`-V`/`--version`: prints version_line() and exits 0 before any other flag is checked."""
    parser.add_argument(
        "-V", "--version", action="version", version=version_line(),
        help="print `pytgi <version>` and exit",
    )  # fmt: skip

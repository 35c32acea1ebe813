"""`--lora-adapters` (TGI's syntax): a comma list of `id`, `name=id` or `name=path`; the name is
what requests select (`adapter_id`, OpenAI's `model`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

# Names travel in URLs, JSON and metric labels: keep them plain.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    name: str
    # A local PEFT directory or a Hub repository id.
    source: str


def check_name(name: str) -> None:
    """ValueError (one line) for a name that is not plain (letters, digits and . _ / -)."""
    if not _NAME.match(name):
        raise ValueError(f"LoRA adapter name {name!r}: use letters, digits and . _ / - "
                         "(starting with a letter or digit)")


def parse_lora_adapters(text: str | None) -> tuple[AdapterSpec, ...]:
    """The adapters of `text`, in order (their order is their wire index). Raises ValueError in
    one line for an empty item, a bad name or a name given twice."""
    if text is None or not text.strip():
        return ()
    specs: list[AdapterSpec] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            raise ValueError(f"--lora-adapters {text!r}: an empty item (two commas in a row?)")
        name, sep, source = item.partition("=")
        name, source = (name.strip(), source.strip()) if sep else (item, item)
        if not source or not _NAME.match(name):
            raise ValueError(f"--lora-adapters item {item!r}: expected `id`, `name=id` or "
                             "`name=path` with a name of letters, digits and . _ / -")
        if any(s.name == name for s in specs):
            raise ValueError(f"--lora-adapters names adapter {name!r} twice")
        specs.append(AdapterSpec(name, source))
    return tuple(specs)

"""Reading a quantization description's fields with one-line errors: a malformed or refused
value names its key, where it was declared and what pytgi serves instead."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NoReturn, TypeVar

from pytgi_shard.quantization.errors import QuantizationError

T = TypeVar("T", int, str, bool)
_KINDS = {int: "an integer", str: "a string", bool: "true or false"}


def field(
    q: Mapping[str, Any],
    key: str,
    kind: type[T],
    source: str,
    default: T | None = None,
    required: bool = False,
) -> T | None:
    """q[key] when it has type `kind` (a JSON true is no int here), `default` when absent or
    null; a QuantizationError when it is required and absent, or of another type."""
    value = q.get(key)
    if value is None:
        if required:
            raise QuantizationError(f"{source} has no `{key}`")
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise QuantizationError(f"{source} `{key}` must be {_KINDS[kind]}, got {value!r}")
    return value


def names(q: Mapping[str, Any], *keys: str) -> tuple[str, ...]:
    """The module names of the first list-valued key among `keys` (modules left unquantized)."""
    for key in keys:
        value = q.get(key)
        if isinstance(value, list):
            return tuple(str(v) for v in value)
    return ()


def refuse(what: str, source: str, instead: str) -> NoReturn:
    """Raises the one-line refusal of `what`, declared by `source`."""
    raise QuantizationError(f"{what} (declared by {source}) is not supported: {instead}")

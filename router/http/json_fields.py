"""Typed reads of decoded JSON bodies: a wrong type or a missing field is a clear 422.

TGI deserializes with serde: unknown fields are ignored, `null` means "not given" for optional
fields, integers are accepted where floats are expected, but not the other way round.
"""

from __future__ import annotations

import json
import math
from typing import Any

from pytgi_router.core.errors import ValidationError
from pytgi_router.http.http_errors import BadRequestError

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def decode_body(body: bytes) -> Any:
    """Bytes to JSON value; 400 for a non-UTF-8 body or malformed JSON (NaN/Infinity included)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadRequestError(f"Request body is not valid UTF-8: {err.reason}") from None
    if not text.strip():
        raise BadRequestError("Request body is empty: expected a JSON object")
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except (json.JSONDecodeError, ValueError) as err:
        raise BadRequestError(f"Request body is not valid JSON: {err}") from None
    except RecursionError:
        raise BadRequestError("Request body is not valid JSON: nested too deeply") from None
    # A lone surrogate can only come from a \uD800-\uDFFF escape (as bytes it is not UTF-8):
    # look for one only then. No tokenizer or client could handle it (serde_json refuses it).
    if ("\\ud" in text or "\\uD" in text) and _has_lone_surrogate(value):
        raise BadRequestError("Request body is not valid JSON: a string holds a lone UTF-16 "
                              "surrogate escape (\\ud800-\\udfff without its pair)")
    return value


def _has_lone_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def wrong_type(path: str, expected: str, value: Any) -> ValidationError:
    shown = json.dumps(value)[:64] if not isinstance(value, (dict, list)) else _kind(value)
    return ValidationError(f"`{path}` must be {expected}, got {_kind(value)} {shown}".rstrip())


def obj(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise wrong_type(path, "a JSON object", value)
    return value


def opt_obj(data: dict[str, Any], key: str, path: str = "") -> dict[str, Any] | None:
    value = data.get(key)
    return None if value is None else obj(value, f"{path}{key}")


def required(data: dict[str, Any], key: str, path: str = "") -> Any:
    if key not in data:
        raise ValidationError(f"missing field `{path}{key}`")
    return data[key]


def req_str(data: dict[str, Any], key: str, path: str = "") -> str:
    value = required(data, key, path)
    if not isinstance(value, str):
        raise wrong_type(f"{path}{key}", "a string", value)
    return value


def opt_str(data: dict[str, Any], key: str, path: str = "") -> str | None:
    value = data.get(key)
    if value is None or isinstance(value, str):
        return value
    raise wrong_type(f"{path}{key}", "a string", value)


def opt_bool(data: dict[str, Any], key: str, path: str = "") -> bool | None:
    value = data.get(key)
    if value is None or isinstance(value, bool):
        return value
    raise wrong_type(f"{path}{key}", "a boolean", value)


def opt_float(data: dict[str, Any], key: str, path: str = "") -> float | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise wrong_type(f"{path}{key}", "a number", value)
    return finite_float(value, f"{path}{key}")


def finite_float(value: int | float, path: str) -> float:
    """`value` as a float, or a 422: JSON integers are unbounded, and one past float's range
    (1 followed by 400 zeros) makes `float()` raise OverflowError rather than give inf."""
    try:
        out = float(value)
    except OverflowError:
        raise wrong_type(path, "a finite number", value) from None
    if not math.isfinite(out):
        raise wrong_type(path, "a finite number", value)
    return out


def opt_int(
    data: dict[str, Any], key: str, path: str = "", *, lo: int = 0, hi: int = U32_MAX
) -> int | None:
    """An integer in [lo, hi] (TGI's unsigned fields: u32 unless said otherwise)."""
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise wrong_type(f"{path}{key}", f"an integer in [{lo}, {hi}]", value)
    if not lo <= value <= hi:
        raise wrong_type(f"{path}{key}", f"an integer in [{lo}, {hi}]", value)
    return value


def str_list(data: dict[str, Any], key: str, path: str = "") -> list[str]:
    """A list of strings; a bare string counts as a list of one (as OpenAI's `stop`)."""
    value = data.get(key)
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise wrong_type(f"{path}{key}", "an array of strings", value)
    return list(value)

"""Environment forms of command-line flags, as TGI reads them: `--max-total-tokens` is also
`MAX_TOTAL_TOKENS`, and the command line wins.

Shared by the router's and the launcher's CLI, so both read the same variables the same way. It imports nothing beyond the standard library.
"""

from __future__ import annotations

import argparse
import ipaddress
from collections.abc import Collection, Mapping
from typing import Any

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def env_name(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_").upper()


def parse_bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {raw!r}")


def env_values(
    parser: argparse.ArgumentParser, environ: Mapping[str, str], skip: Collection[str] = ()
) -> dict[str, Any]:
    """The values of the parser's flags found in the environment, by dest (a blank variable is
    unset); exits through `parser.error` on a value the flag would reject."""
    out: dict[str, Any] = {}
    for action in parser._actions:
        if not action.option_strings or action.dest == "help" or action.dest in skip:
            continue
        flag = max(action.option_strings, key=len)
        raw = environ.get(env_name(flag))
        if raw is None or raw.strip() == "":
            continue
        try:
            out[action.dest] = _env_value(action, raw)
        except ValueError:
            parser.error(f"environment variable {env_name(flag)}={raw!r} is not valid for {flag}")
        except argparse.ArgumentTypeError as e:
            # The flag's own parser explains (lists the valid values, says why one is refused).
            parser.error(f"environment variable {env_name(flag)}={raw!r} is not valid for "
                         f"{flag}: {e}")
    if "hostname" in out and not _is_bindable(out["hostname"]):
        # Containers export HOSTNAME as their own name, which is no address to bind (TGI too).
        del out["hostname"]
    return out


def _env_value(action: argparse.Action, raw: str) -> Any:
    if isinstance(action, argparse._StoreTrueAction):
        return parse_bool(raw)
    if action.dest == "cors_allow_origin":
        return [origin.strip() for origin in raw.split(",") if origin.strip()]
    value = action.type(raw) if callable(action.type) else raw
    if action.choices is not None and value not in action.choices:
        raise ValueError(raw)
    return value


def _is_bindable(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def resolve_input_length_alias(
    parser: argparse.ArgumentParser, values: dict[str, Any], cli: Mapping[str, Any]
) -> None:
    """Folds TGI's legacy `--max-input-length` into `max_input_tokens` in `values` (command line,
    then environment); both on the command line is a usage error."""
    legacy = values.pop("max_input_length", None)
    if legacy is None:
        return
    if "max_input_tokens" in cli and "max_input_length" in cli:
        parser.error("--max-input-tokens and --max-input-length are aliases: set only one")
    if "max_input_length" in cli or "max_input_tokens" not in values:
        values["max_input_tokens"] = legacy

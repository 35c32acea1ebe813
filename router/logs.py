"""Log output of the router process: human-readable lines, or one JSON object per line."""

from __future__ import annotations

import logging
import os
import sys

from pytgi_proto.contracts import JsonFormatter


def announce(message: str, json_output: bool) -> None:
    """A line that must always be printed (e.g. "ready"), whatever LOG_LEVEL says."""
    if json_output:
        record = logging.LogRecord("pytgi.router", logging.INFO, "", 0, message, None, None)
        print(JsonFormatter().format(record), flush=True)
    else:
        print(message, flush=True)


def configure_logging(json_output: bool) -> None:
    """Called once from the CLI; LOG_LEVEL (TGI's variable) picks the level, default INFO."""
    handler = logging.StreamHandler(sys.stdout)
    if json_output:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)-5s %(name)s: %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    level = os.environ.get("LOG_LEVEL", "INFO").upper()
    root.setLevel(level if level in logging.getLevelNamesMapping() else "INFO")
    # Uvicorn's start/stop banners and access lines would double the router's own lines.
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)

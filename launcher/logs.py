"""The launcher's output: its own log records and its children's lines, as text or JSON lines.

Children write to pipes that reader threads drain; every line goes through one LogSink so lines
from different processes never interleave mid-line. In JSON mode each child's JSON line gets a
"process" field ("shard-0", "router"); a line that is not JSON (a raw traceback, a library's
print) is wrapped into the same shape, so the whole stream stays machine-readable.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from typing import TextIO

from pytgi_proto.contracts import utc_timestamp
from pytgi_shard.weights import conversion as weights_conversion
from pytgi_shard.weights import resolution as model_resolution

LAUNCHER = "launcher"


class LogSink:
    """Thread-safe writer of whole lines; `json_output` picks the format."""

    def __init__(self, json_output: bool, stream: TextIO | None = None) -> None:
        self.json_output = json_output
        self.stream = stream or sys.stdout
        self._lock = threading.Lock()

    def child_line(self, process: str, line: str) -> None:
        self._write(self._json_child(process, line) if self.json_output else f"[{process}] {line}")

    def record(self, level: str, message: str, created: float | None = None) -> None:
        created = time.time() if created is None else created
        if self.json_output:
            text = json.dumps({"timestamp": utc_timestamp(created), "level": level,
                               "process": LAUNCHER, "target": "pytgi.launcher",
                               "message": message}, ensure_ascii=False)
        else:
            text = f"{time.strftime('%H:%M:%S', time.localtime(created))} {level:<5} {message}"
        self._write(text)

    def _json_child(self, process: str, line: str) -> str:
        try:
            obj = json.loads(line)
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            obj = {"timestamp": utc_timestamp(time.time()), "level": "INFO", "message": line}
        obj.setdefault("process", process)
        return json.dumps(obj, ensure_ascii=False)

    def _write(self, text: str) -> None:
        with self._lock:
            try:
                self.stream.write(text + "\n")
                self.stream.flush()
            except (OSError, ValueError):
                # A closed or broken stdout (piped into `head`) must not kill the supervisor.
                pass


class SinkHandler(logging.Handler):
    """Routes the launcher's own `logging` records into the sink."""

    def __init__(self, sink: LogSink) -> None:
        super().__init__()
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + logging.Formatter().formatException(record.exc_info)
        self.sink.record(record.levelname, message, record.created)


# The shard's model resolution runs in the launcher's own process, before any child starts: its
# records ("resolving ...", "converting ... once") belong in the launcher's output too.
ROUTED_LOGGERS = ("pytgi.launcher", model_resolution.log.name, weights_conversion.log.name)


def configure_logging(sink: LogSink, level: str = "INFO") -> logging.Logger:
    """Sends the launcher's records (and those of ROUTED_LOGGERS) into `sink`; returns the
    launcher's logger."""
    handler = SinkHandler(sink)
    for name in ROUTED_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level if level in logging.getLevelNamesMapping() else "INFO")
        logger.propagate = False
    return logging.getLogger("pytgi.launcher")

"""Log output of a shard: plain lines, or one JSON object per line that the launcher relays.

The JSON shape is pytgi_proto.contracts' (the router's too), so one parser reads both.
"""

from __future__ import annotations

import logging
import sys

from pytgi_proto.contracts import JsonFormatter


def configure_logging(json_output: bool, level: str, rank: int) -> None:
    handler = logging.StreamHandler(sys.stdout)
    if json_output:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s %(levelname)-5s shard-{rank} %(name)s: %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper() if level.upper() in logging.getLevelNamesMapping() else "INFO")

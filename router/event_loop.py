"""The event loop the router runs on: uvloop where it is installed (Linux, macOS), else asyncio's.

uvloop cuts the router's CPU per streamed token by about a fifth (its socket writes, polling and
callback dispatch are C). The benchmark's load generator and in-process rows use the same loop,
so that they measure the router as it runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on new_event_loop()."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)

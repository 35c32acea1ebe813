"""Errors a shard call can end with; the gRPC server maps each to a status code."""

from __future__ import annotations

from collections.abc import Iterator


class ShardError(Exception):
    """Base of the errors that are the caller's fault and leave the shard's state intact."""


class InvalidRequest(ShardError):
    """A call the shard cannot serve as sent (gRPC INVALID_ARGUMENT)."""


class BatchNotFound(ShardError):
    """A batch id that is not in the cache (gRPC NOT_FOUND)."""

    def __init__(self, batch_id: int) -> None:
        super().__init__(f"batch {batch_id} not found in the shard's cache")
        self.batch_id = batch_id


class OutOfMemory(ShardError):
    """Not enough memory for what was asked (gRPC RESOURCE_EXHAUSTED); the message names the flag
    to change."""


def error_chain(error: BaseException | None) -> Iterator[BaseException]:
    """`error`, then what it was raised from or during, once each (a servicer's abort wraps the
    engine's exception; a cycle of contexts ends the walk)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__

"""Live LoRA loading and unloading (--enable-lora-runtime-updates on the shards): what
/v1/load_lora_adapter and /v1/unload_lora_adapter do, with vLLM's answers and errors.

A load reserves the lowest free wire index, asks every rank to read the adapter there (each runs
the start-up checks and refuses in one line), and makes the name selectable only once all ranks
have it; a rank's refusal unloads the index on all of them. An unload makes the name unselectable
at once (new requests get the unknown-adapter 422), then waits for the requests in flight under
it to end before the shards free the index, so they finish under the weights they started with.
One update at a time, and none while a restarted shard group gets the table's adapters back
(Infer.reconnect holds `held()` around its new client, handshake and `replay`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

from pytgi_router.core.errors import InferError
from pytgi_router.core.lora_adapters import AdapterTable
from pytgi_router.core.shard_client import AdapterRefused, ShardCallError, ShardClient

if TYPE_CHECKING:
    from pytgi_router.core.infer import Infer

logger = logging.getLogger(__name__)

# A refusal that says the adapter is not there: vLLM's 404 ("No adapter found").
_NOT_FOUND = ("does not exist", "cannot fetch")


class LoraUpdateError(InferError):
    """vLLM's refusals: 400 (InvalidUserInput, BadRequestError), 404 (NotFoundError)."""

    metric_label = "validation"

    def __init__(self, message: str, status_code: int = 400,
                 error_type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status_code = status_code
        self.error_type = error_type


class LoraUpdates:
    def __init__(self, infer: Infer) -> None:
        self.infer = infer
        self._lock = asyncio.Lock()
        # Unloads waiting for their requests in flight (kept so that they are not collected).
        self._pending: set[asyncio.Task[None]] = set()

    @property
    def table(self) -> AdapterTable:
        return self.infer.adapters

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        """No load or unload runs meanwhile: a shard-group restart holds this from the new
        client to the end of `replay`, so a live load neither races the replay nor lands on
        the new group before it and is then loaded there twice (refused, and dropped)."""
        async with self._lock:
            yield

    async def replay(self, served: Sequence[str]) -> None:
        """Under `held()`: replay_loads on the (new) client; an adapter dropped there loses its
        per-adapter metric series, as an unload does."""
        dropped = await replay_loads(self.infer.client, self.table, served, self._timeout())
        for name in dropped:
            self.infer.metrics.forget_adapter(name)

    async def load(self, name: str, path: str) -> str:
        """vLLM's POST /v1/load_lora_adapter: its success text, or LoraUpdateError."""
        if not name or not path:
            raise LoraUpdateError("Both 'lora_name' and 'lora_path' must be provided.",
                                  error_type="InvalidUserInput")
        async with self._lock:
            table = self.table
            if table.get(name) is not None:
                raise LoraUpdateError(f"The lora adapter '{name}' has already been loaded.",
                                      error_type="InvalidUserInput")
            index = table.reserve()
            rank = await self._load_at(name, path, index)
            table.add(name, index, path)
        logger.info("Loaded new LoRA adapter: name '%s', path '%s' (index %d, rank %d)", name,
                    path, index, rank)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def _load_at(self, name: str, path: str, index: int) -> int:
        """Every rank loads the adapter at `index` (its LoRA rank r returned), or none keeps it: on
        a refusal or a failure the index is unloaded on all, and the caller gets vLLM's answer
        for it. A refused index is free again; after a failure (a time-out) a rank may still
        finish the load once the roll-back has passed, so that index stays reserved: a later
        load there would meet it."""
        client = self.infer.client
        try:
            return await client.load_adapter(name, path, index, self._timeout())
        except ShardCallError as err:
            await _roll_back(client, index, self._timeout())
            if isinstance(err, AdapterRefused):
                self.table.release(index)
            raise _load_refusal(err) from err

    async def unload(self, name: str) -> str:
        """vLLM's POST /v1/unload_lora_adapter: unselectable at once; the shards free it once
        its requests in flight have ended."""
        if not name:
            raise LoraUpdateError("either 'lora_name' and 'lora_int_id' needs to be provided.",
                                  error_type="InvalidUserInput")
        async with self._lock:
            ref = self.table.remove(name)
        if ref is None:
            raise LoraUpdateError(f"The lora adapter '{name}' cannot be found.", 404,
                                  "NotFoundError")
        self.infer.metrics.forget_adapter(name)
        task = asyncio.get_running_loop().create_task(self._free(ref.index))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        logger.info("Removed LoRA adapter: name '%s' (index %d, %d request(s) in flight)", name,
                    ref.index, self.table.in_flight(ref.index))
        return f"Success: LoRA adapter '{name}' removed successfully."

    async def _free(self, index: int) -> None:
        """Frees `index` on the shards, then for a new load, once no request under it is queued
        or in the running batch (a cancelled one included: its rows stay there, on the shards
        too, until the scheduler retires it; a load reusing the index before that would be
        refused by the shards, the index still unloading there)."""
        await self.table.until_idle(index)
        try:
            await self.infer.client.unload_adapter(index, self._timeout())
        except ShardCallError as err:  # a shard group that restarted has no such index
            logger.warning("UnloadAdapter %d: %s", index, err)
        self.table.release(index)

    def _timeout(self) -> float | None:
        return self.infer.settings.shard_step_timeout_s


def _load_refusal(err: ShardCallError) -> LoraUpdateError:
    """vLLM's status for a failed load: 404 for an adapter that is not there, 400 for one the
    shards refuse (the reason theirs), 500 for a shard call that failed."""
    if not isinstance(err, AdapterRefused):
        return LoraUpdateError(str(err), 500, "InternalServerError")
    message = str(err)
    if any(s in message for s in _NOT_FOUND):
        return LoraUpdateError(message, 404, "NotFoundError")
    return LoraUpdateError(message)


async def _roll_back(client: ShardClient, index: int, timeout: float | None) -> None:
    """Unloads `index` from the ranks that did load it (the others refuse: ignored)."""
    with contextlib.suppress(ShardCallError):
        await client.unload_adapter(index, timeout)


async def replay_loads(client: ShardClient, table: AdapterTable, served: Sequence[str],
                       timeout: float | None) -> list[str]:
    """Brings a shard group that restarted (it knows only its --lora-adapters, `served`) back
    to the table: a start-up adapter unloaded since is unloaded again, the live-loaded ones are
    loaded again at their indices; one that no longer loads is dropped, with a warning. The
    names dropped (the caller forgets their metrics)."""
    dropped: list[str] = []
    for index, name in enumerate(served, 1):
        ref = table.get(name) if name else None
        if name and (ref is None or ref.index != index):
            await _roll_back(client, index, timeout)
    for ref in table.refs():
        if ref.source is None:
            continue
        try:
            await client.load_adapter(ref.name, ref.source, ref.index, timeout)
        except AdapterRefused as err:
            logger.warning("LoRA adapter %s not reloaded after the shards restarted: %s",
                           ref.name, err)
            table.remove(ref.name)
            table.release(ref.index)
            dropped.append(ref.name)
    return dropped

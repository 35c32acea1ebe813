"""LoadAdapter and UnloadAdapter as the engine answers them: the AdapterSet's work, its
refusals turned into InvalidRequest (the router's one-line 400/404 naming the reason)."""

from __future__ import annotations

from collections.abc import Set

from pytgi_proto import generate_pb2
from pytgi_shard.errors import InvalidRequest
from pytgi_shard.lora.adapter_set import AdapterSet, HostAdapter


def read_adapter(adapters: AdapterSet, request: generate_pb2.LoadAdapterRequest) -> HostAdapter:
    """LoadAdapter's reading and checks, safe off the engine thread (InvalidRequest naming why
    an adapter does not fit)."""
    try:
        return adapters.read(request.name, request.source)
    except ValueError as e:
        raise InvalidRequest(str(e)) from e
    except Exception as e:  # noqa: BLE001 - an unreadable file is the caller's, in one line
        first = (str(e).splitlines() or [""])[0]
        raise InvalidRequest(f"LoRA adapter {request.name!r}: cannot read {request.source}: "
                             f"{type(e).__name__}: {first}") from e


def install_adapter(adapters: AdapterSet, in_use: Set[int], request: generate_pb2.LoadAdapterRequest,
                    host: HostAdapter) -> generate_pb2.LoadAdapterResponse:
    """LoadAdapter's install, between steps (`in_use`: the adapters of the cached batches)."""
    try:
        adapters.install(request.index, host, in_use)
    except ValueError as e:
        raise InvalidRequest(str(e)) from e
    return generate_pb2.LoadAdapterResponse(rank=host.rank)


def unload_adapter(adapters: AdapterSet, in_use: Set[int],
                   request: generate_pb2.UnloadAdapterRequest) -> None:
    """UnloadAdapter: new requests for it are refused; its live rows finish first."""
    try:
        adapters.unload(request.index, in_use)
    except KeyError:
        raise InvalidRequest(f"no LoRA adapter is loaded at index {request.index}") from None

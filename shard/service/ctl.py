"""`pytgi-shard ctl ADDRESS info|health|discover|clear-cache`: operate a running shard over gRPC.

ADDRESS is a unix socket path (`/tmp/text-generation-server-0`), a `unix://` URI, or `host:port`
(a shard pod in Kubernetes). Output is JSON for `info`, one URL per line for `discover`, and a
short word otherwise; the exit status is 0 on success and 1 with the gRPC error on stderr. A shard
started with a token (--shard-token) needs the same one in SHARD_TOKEN.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

ACTIONS = ("info", "health", "discover", "clear-cache")


def grpc_target(address: str) -> str:
    if address.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
        return address
    if address.startswith("/") or address.startswith("."):
        return f"unix://{address}"
    return address


def add_ctl_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("ctl", help="query or operate a running shard over gRPC")
    p.add_argument("address", help="socket path, unix:///path, or host:port")
    p.add_argument("action", choices=ACTIONS)
    p.add_argument("--batch-id", type=int, help="clear-cache: drop only this batch")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per call (default 10)")
    p.set_defaults(run=run_ctl)


def run_ctl(args: argparse.Namespace) -> int:
    import grpc

    try:
        token = os.environ.get("SHARD_TOKEN") or None
        print(call(grpc_target(args.address), args.action, args.batch_id, args.timeout, token))
    except grpc.RpcError as e:
        code = e.code().name if hasattr(e, "code") else "UNKNOWN"
        details = e.details() if hasattr(e, "details") else str(e)
        print(f"pytgi-shard ctl: {args.action} on {args.address} failed: {code}: {details}",
              file=sys.stderr)
        return 1
    return 0


def call(
    target: str,
    action: str,
    batch_id: int | None = None,
    timeout: float = 10.0,
    token: str | None = None,
) -> str:
    """Runs one action against the shard at `target` (with its `token`, if it has one); returns
    what to print."""
    import grpc
    from google.protobuf.json_format import MessageToDict

    from pytgi_proto import generate_pb2, generate_pb2_grpc

    metadata = None if token is None else (("authorization", f"Bearer {token}"),)
    with grpc.insecure_channel(target) as channel:
        stub = generate_pb2_grpc.TextGenerationServiceStub(channel)
        if action == "info":
            reply: Any = stub.Info(generate_pb2.InfoRequest(), timeout=timeout, metadata=metadata)
            info = MessageToDict(reply, preserving_proto_field_name=True,
                                 always_print_fields_with_no_presence=True)
            return json.dumps(info, indent=2)
        if action == "health":
            # The shard's own Health runs a tiny forward pass: stronger than grpc.health.v1.
            stub.Health(generate_pb2.HealthRequest(), timeout=timeout, metadata=metadata)
            return "healthy"
        if action == "discover":
            reply = stub.ServiceDiscovery(generate_pb2.ServiceDiscoveryRequest(), timeout=timeout, metadata=metadata)
            return "\n".join(reply.urls)
        request = generate_pb2.ClearCacheRequest()
        if batch_id is not None:
            request.id = batch_id
        stub.ClearCache(request, timeout=timeout, metadata=metadata)
        return "cleared" if batch_id is None else f"cleared batch {batch_id}"

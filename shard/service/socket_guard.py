"""Claims a unix-socket path for this shard and releases only what this shard bound.

Two servers on one host that share a socket path ruin each other: gRPC unlinks an existing
socket file before binding, so the newcomer silently takes over the path (the first server's
router then talks to a stranger) and whoever exits last deletes the other's socket. So a shard
refuses a path that a live server answers on, removes only a stale file nobody listens on, and at
exit deletes the file only when it is still the one it bound (same inode).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

CONNECT_TIMEOUT_S = 1.0


class SocketInUse(RuntimeError):
    """Another live process serves on the path this shard was told to bind."""


def live_listener(path: str) -> bool:
    """Whether a process accepts connections on the unix socket at `path`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(CONNECT_TIMEOUT_S)
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def claim_socket(path: str) -> None:
    """Makes `path` free to bind: SocketInUse when a live server answers there, else removes a
    stale socket file left by a dead process (it would otherwise look like readiness)."""
    if not os.path.lexists(path):
        return
    if live_listener(path):
        raise SocketInUse(
            f"{path} is already served by another live process (another pytgi instance on this "
            "host?): give this shard another socket base name with --uds-path (pytgi-launcher: "
            "--shard-uds-path, or another --port, from which the default is derived)"
        )
    Path(path).unlink(missing_ok=True)


def socket_inode(path: str) -> int | None:
    """The inode of the file at `path`, None when there is none."""
    try:
        return os.lstat(path).st_ino
    except FileNotFoundError:
        return None


def release_socket(path: str, inode: int | None) -> None:
    """Deletes `path` only if it is still the socket this process bound (inode `inode`)."""
    if inode is not None and socket_inode(path) == inode:
        Path(path).unlink(missing_ok=True)

"""Exec shim for supervised children: `python -m pytgi_launcher.exec_child PARENT_PID ARGV...`.

Arms PR_SET_PDEATHSIG (the kernel SIGKILLs this process when the launcher dies), checks the
launcher is still alive, then replaces itself with ARGV. Doing this here, after exec, instead of
in a subprocess preexec_fn keeps the launcher's spawn free of Python code between fork and exec:
with a preexec_fn CPython must fork() and run at-fork hooks in the child, and gRPC's hooks (the
launcher talks gRPC to the shards) could abort the child before it ever ran (SIGABRT,
"epoll_wait error: Bad file descriptor").
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> None:
    parent_pid, command = int(argv[0]), argv[1:]
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        # The launcher died before the death signal was armed.
        os.kill(os.getpid(), signal.SIGKILL)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])

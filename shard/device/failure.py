"""Unrecoverable device errors: the shard exits so that the launcher restarts the group.

After a CUDA "device-side assert", an illegal memory access or a launch failure the CUDA context
is poisoned: every later kernel fails with the same error, so a shard that reported it and kept
serving would answer errors forever, and the launcher restarts only shards that exit. Out of
memory is not among them: it leaves the context usable and the shard recovers by itself.
"""

from __future__ import annotations

import logging
import os

from pytgi_shard.errors import error_chain

log = logging.getLogger(__name__)

# The exit status of a shard that stopped on a device failure (the launcher restarts on any
# non-zero status; a distinct one tells this case apart in its log).
DEVICE_FAILURE_EXIT_CODE = 3

# Substrings of the messages CUDA (through torch or Triton) gives the sticky errors, lower-case.
_STICKY = (
    "device-side assert",
    "illegal memory access",
    "illegal instruction",
    "misaligned address",
    "unspecified launch failure",
    "hardware stack error",
    "uncorrectable ecc error",
    "cudaerrorassert",
    "cudaerrorillegaladdress",
    "cudaerrorillegalinstruction",
    "cudaerrormisalignedaddress",
    "cudaerrorlaunchfailure",
    "cudaerrorhardwarestackerror",
    "cudaerroreccuncorrectable",
)


def is_device_failure(err: BaseException) -> bool:
    """True when `err`, or an exception it was raised from, is a torch.AcceleratorError /
    RuntimeError whose message names a sticky device error (the context cannot be used again).
    Other exception types (a ValueError quoting a client's text) never count."""
    return any(
        isinstance(e, RuntimeError) and any(marker in str(e).lower() for marker in _STICKY)
        for e in error_chain(err)
    )


def exit_on_device_failure(err: BaseException) -> None:
    """Exits the process at once (no clean-up: it would touch the broken device and could hang)
    when `err` is an unrecoverable device error; returns otherwise."""
    if not is_device_failure(err):
        return
    log.critical("unrecoverable device error, exiting with status %d so that the launcher "
                 "restarts the shard group: %s: %s", DEVICE_FAILURE_EXIT_CODE,
                 type(err).__name__, err)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(DEVICE_FAILURE_EXIT_CODE)

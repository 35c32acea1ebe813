"""Issue 11 item 7: after an unrecoverable device error the shard exits (status 3, a clear log
line) so that the launcher's group restart applies, instead of answering errors forever."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from pytgi_proto import generate_pb2, generate_pb2_grpc
from pytgi_shard.device.failure import DEVICE_FAILURE_EXIT_CODE, is_device_failure
from tests.shard_process import ShardProcesses

ASSERT = ("CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously "
          "reported at some other API call, so the stacktrace below might be incorrect.")


class AcceleratorError(RuntimeError):
    """torch.AcceleratorError's shape (a RuntimeError subclass; absent from older torch)."""


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError(ASSERT),
        AcceleratorError("CUDA error: an illegal memory access was encountered"),
        RuntimeError("CUDA error: unspecified launch failure"),
        RuntimeError("CUDA driver error: cudaErrorLaunchFailure"),
        RuntimeError("Triton Error [CUDA]: an illegal instruction was encountered"),
        RuntimeError("CUDA error: misaligned address"),
        RuntimeError("CUDA error: uncorrectable ECC error encountered"),
    ],
)
def test_sticky_device_errors_are_unrecoverable(error: BaseException) -> None:
    assert is_device_failure(error)


def test_a_wrapped_device_error_is_found_through_its_cause() -> None:
    try:
        try:
            raise RuntimeError(ASSERT)
        except RuntimeError as inner:
            raise ValueError("prefill failed") from inner
    except ValueError as outer:
        assert is_device_failure(outer)


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),  # recoverable
        RuntimeError("shape mismatch"),
        ValueError("the client wrote: device-side assert"),  # not a device's exception type
        KeyError("illegal memory access"),
    ],
)
def test_other_errors_are_recoverable(error: BaseException) -> None:
    assert not is_device_failure(error)


# Runs the real shard CLI with the engine's Prefill failing as a broken device does, and its
# Decode failing with an ordinary error.
FAULTY_SHARD = f"""
import sys
from pytgi_shard.service import cli
from pytgi_shard.engine.engine import Engine

def prefill(self, request):
    raise RuntimeError({ASSERT!r})

def decode(self, request):
    raise RuntimeError("an ordinary bug")

Engine.prefill = prefill
Engine.decode = decode
sys.exit(cli.main(sys.argv[1:]))
"""


def test_the_shard_exits_on_a_device_failure(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    shards = ShardProcesses(tiny_model("llama"), 1, tmp_path, str(tmp_path / "s"), [])
    with shards.log_path(0).open("wb") as log:
        shards.procs.append(subprocess.Popen(
            [sys.executable, "-c", FAULTY_SHARD, "serve", str(shards.model_path),
             "--uds-path", str(shards.uds_path)], stdout=log, stderr=subprocess.STDOUT))
    try:
        shards.wait_ready()
        with grpc.insecure_channel(shards.urls[0]) as channel:
            stub = generate_pb2_grpc.TextGenerationServiceStub(channel)
            with pytest.raises(grpc.RpcError) as ordinary:
                stub.Decode(generate_pb2.DecodeRequest(), timeout=30)
            assert ordinary.value.code() == grpc.StatusCode.INTERNAL
            assert shards.procs[0].poll() is None  # an ordinary error: still serving
            with pytest.raises(grpc.RpcError):
                stub.Prefill(generate_pb2.PrefillRequest(batch=generate_pb2.Batch(id=0)),
                             timeout=30)
        assert shards.procs[0].wait(timeout=30) == DEVICE_FAILURE_EXIT_CODE
        assert "unrecoverable device error, exiting with status 3" in shards.output(0)
    finally:
        shards.stop()

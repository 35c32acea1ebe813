"""`pytgi-shard serve` flags and their environment fallbacks, parsed into ShardSettings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pytgi_proto.contracts import DEFAULT_UDS_PATH
from pytgi_shard.service.cli import build_parser, settings_from_args
from pytgi_shard.settings import ShardSettings


def parse(*argv: str, env: dict[str, str] | None = None) -> ShardSettings:
    return settings_from_args(build_parser().parse_args(["serve", "/m", *argv]), env or {})


def test_defaults_serve_rank_0_of_1_on_the_tgi_socket() -> None:
    s = parse()
    assert (s.model_path, s.rank, s.world_size, s.block_size) == (Path("/m"), 0, 1, 16)
    assert s.listen_address == f"unix://{DEFAULT_UDS_PATH}-0" and s.port is None


def test_env_fills_unset_flags_and_flags_win() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "4000",
           "CUDA_MEMORY_FRACTION": "0.5"}  # fmt: skip
    s = parse("--uds-path", "/tmp/x", env=env)
    assert (s.rank, s.world_size, s.master_addr, s.master_port) == (1, 2, "10.0.0.1", 4000)
    assert s.cuda_memory_fraction == 0.5 and s.listen_address == "unix:///tmp/x-1"
    assert parse("--rank", "0", env=env).rank == 0


def test_tcp_port_with_an_advertised_address() -> None:
    s = parse("--port", "50051", "--advertise-address", "pod-0.shards:50051", "--dtype", "bfloat16")
    assert s.uds_path is None and s.listen_address == "[::]:50051"
    assert s.advertise_address == "pod-0.shards:50051" and s.dtype == "bfloat16"


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--rank", "2", "--world-size", "2"], {}, "--rank"),
        (["--cuda-memory-fraction", "1.5"], {}, "--cuda-memory-fraction"),
        (["--block-size", "0"], {}, "--block-size"),
        ([], {"RANK": "one"}, "RANK='one'"),
    ],
)
def test_bad_settings_name_the_flag(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse(*argv, env=env)


def test_the_console_script_reports_bad_flags_without_loading_anything(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "pytgi-shard"
    result = subprocess.run(
        [str(script), "serve", str(tmp_path), "--world-size", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and "--world-size must be >= 1" in result.stderr
    both = subprocess.run(
        [str(script), "serve", str(tmp_path), "--port", "1", "--uds-path", "/x"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert both.returncode == 2 and "not allowed with argument" in both.stderr

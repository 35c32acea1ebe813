"""The launcher counts GPUs without importing torch where no GPU driver's device node exists."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pytgi_launcher.launch import driver_present, visible_gpus


def test_no_driver_node_means_no_gpu(tmp_path: Path) -> None:
    assert not driver_present(tmp_path)
    assert visible_gpus(tmp_path) == (0, "")


@pytest.mark.parametrize("node", ["nvidiactl", "nvidia0", "kfd", "dxg"])
def test_any_driver_node_sends_the_count_to_torch(tmp_path: Path, node: str) -> None:
    (tmp_path / node).touch()
    assert driver_present(tmp_path)


def test_counting_no_gpu_imports_no_torch(tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path; from pytgi_launcher.launch import visible_gpus;"
        f"assert visible_gpus(Path({str(tmp_path)!r})) == (0, ''); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

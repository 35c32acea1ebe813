"""`pytgi-launcher --env`: what a bug report needs about the machine and the installed stack."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

PACKAGES = (
    "pytgi", "torch", "transformers", "tokenizers", "safetensors", "huggingface-hub", "grpcio",
    "protobuf", "starlette", "uvicorn", "prometheus-client", "opentelemetry-sdk",
)


def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_total() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                kib = int(line.split()[1])
                return f"{kib / 2**20:.1f} GiB"
    except (OSError, ValueError):
        pass
    return "unknown"


def gpu_lines() -> list[str]:
    """CUDA as torch sees it (torch is imported only here, for --env)."""
    try:
        import torch
    except ImportError:
        return ["torch: not importable"]
    lines = [f"CUDA available: {torch.cuda.is_available()}",
             f"torch CUDA build: {torch.version.cuda or 'none (CPU build)'}"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            lines.append(f"GPU {i}: {props.name}, {props.total_memory / 2**30:.1f} GiB, "
                         f"compute capability {props.major}.{props.minor}")
    return lines


def nvidia_smi() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe], capture_output=True, text=True, timeout=15, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"nvidia-smi failed: {e}"
    return done.stdout.rstrip() or done.stderr.rstrip()


def environment_report() -> str:
    rows = [
        ("Python", f"{platform.python_version()} ({sys.executable})"),
        ("Platform", platform.platform()),
        ("CPU", f"{cpu_model()}, {os.cpu_count()} logical cores"),
        ("Memory", memory_total()),
    ]
    rows += [(name, package_version(name)) for name in PACKAGES]
    width = max(len(k) for k, _ in rows)
    lines = ["pytgi environment"] + [f"  {k:<{width}}  {v}" for k, v in rows]
    lines += [f"  {line}" for line in gpu_lines()]
    smi = nvidia_smi()
    lines.append("nvidia-smi: not found" if smi is None else f"nvidia-smi:\n{smi}")
    return "\n".join(lines)

"""The benchmark models by short name, built once and reused: `python -m pytgi_bench.compare.build_model`.

    python -m pytgi_bench.compare.build_model --shape 8b --root /tmp/pytgi-gpu/models [--record F.jsonl]

Shapes: `8b` (Llama-3-8B), `1b` (Llama-3.2-1B), `cpu-small`; random weights, EOS-free, the
demo model's tokenizer (see model_builder). On a GPU they are built there in bfloat16 — an 8B
model in float32 on the CPU would need 32 GB first. Stdout gets the model directory alone, for
scripts; stderr says what happened. `--record` appends how long the build took and how much it
wrote (an 8B checkpoint is 16 GB, worth knowing when a benchmark run has minutes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pytgi_bench.compare.model_builder import (
    CPU_SMALL,
    LLAMA3_8B,
    LLAMA32_1B,
    LlamaShape,
    build_random_llama,
    is_checkpoint,
)

REPO = Path(__file__).resolve().parents[2]
# Its tokenizer gives every random model real text to encode and decode.
DEMO_MODEL = REPO / "launcher" / "demo_model"
SHAPES: dict[str, LlamaShape] = {"8b": LLAMA3_8B, "1b": LLAMA32_1B, "cpu-small": CPU_SMALL}
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True, slots=True)
class BuiltModel:
    shape: str
    path: str
    dtype: str
    device: str
    seconds: float
    bytes: int
    # True when an earlier build was found and reused (seconds is then the check alone).
    reused: bool


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> str:
    return "bfloat16" if device.startswith("cuda") else "float32"


def build(
    shape: str, root: Path, dtype: str | None = None, device: str | None = None
) -> BuiltModel:
    """Builds (or finds) `shape` under `root`/<shape name>."""
    spec = SHAPES[shape]
    device = device or default_device()
    dtype = dtype or default_dtype(device)
    out = root / spec.name
    marker = out / "bench_model.json"
    before = marker.stat().st_mtime_ns if is_checkpoint(out) and marker.is_file() else None
    start = time.perf_counter()
    build_random_llama(out, spec, DEMO_MODEL, dtype=_DTYPES[dtype], device=device)
    seconds = time.perf_counter() - start
    # The builder rewrites its marker on every build and leaves it alone when it reuses one.
    reused = before is not None and marker.stat().st_mtime_ns == before
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    return BuiltModel(shape, str(out), dtype, device, round(seconds, 2), size, reused)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pytgi_bench.compare.build_model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--root", type=Path, required=True, help="models go to ROOT/<shape name>")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                   help="default: bfloat16 on a GPU, float32 on the CPU")
    p.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    p.add_argument("--record", type=Path, default=None, help="append a JSON line about the build")
    args = p.parse_args(argv)
    built = build(args.shape, args.root, args.dtype, args.device)
    verb = "found" if built.reused else f"built in {built.seconds:.1f} s"
    # The directory alone on stdout, for `model=$(python -m pytgi_bench.compare.build_model ...)`.
    print(f"{built.shape}: {verb}, {built.bytes / 2**30:.2f} GiB, {built.dtype} "
          f"on {built.device}: {built.path}", file=sys.stderr, flush=True)
    if args.record is not None:
        args.record.parent.mkdir(parents=True, exist_ok=True)
        with args.record.open("a") as f:
            f.write(json.dumps(asdict(built)) + "\n")
    print(built.path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

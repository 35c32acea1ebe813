"""--quantize modes against float on a ~20M-parameter Llama: decode tokens/s at batch 1 and 64,
and weight memory, each mode loaded by the shard's own start-up (load_engine with --quantize).

    python -m pytgi_bench.experiments.quantization [--modes float,eetq,...] [--rounds 3] [--threads N]
        [--out PATH]
    nice -n 10 python -m pytgi_bench.experiments.quantization --threads 1 --rounds 7 \
        --out bench/results/cpu/quantization.json

The model: random weights in Hugging Face layout (bench/compare/model_builder.py), 512 hidden, 1536
intermediate, 6 layers, 8 heads, 4 KV heads, the demo model's 4,096-token vocabulary: 18.9M
parameters in the quantized linears, 23.1M in all. Every mode's engine is loaded once, then
decode is measured in rotation (mode by mode, `--rounds` times): tokens/s is the best round and
the median is shown beside it, because other work on a shared machine only ever slows a round.
Decode steps are timed as bench/compare/engine_steps.py times them (Prefill, then Decode calls; the
median step). Weight memory is every parameter and buffer the model holds (the quantized
linears with their scales, the float embeddings, norms and LM head), and the quantized linears
alone. The kernels behind each mode are timed too (bench/experiments/on_load_kernels.py). `gptq` and `awq`
load a 4-bit export of the same model (groups of 128, bench/experiments/gptq_awq_export.py). On a GPU
(bench/gpu.sh) the same runs in bfloat16.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pytgi_bench.compare.engine_steps import measure
from pytgi_bench.compare.model_builder import LlamaShape, build_random_llama
from pytgi_bench.experiments.gptq_awq_export import export
from pytgi_bench.experiments.on_load_kernels import KernelTime, measure_kernels
from pytgi_proto import generate_pb2

QUANT_20M = LlamaShape("quant-20m", 512, 1536, 6, 8, 4)
MODES = ("float", "eetq", "bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4", "fp8", "gptq",
         "awq")  # fmt: skip
# Pre-quantized modes: the float model's export (bench/experiments/gptq_awq_export.py), detected, no flag.
EXPORTED = ("gptq", "awq")
DEMO_MODEL = Path(__file__).resolve().parents[2] / "launcher" / "demo_model"
INPUT_LEN = 32


@dataclass(slots=True)
class ModeResult:
    mode: str
    weight_bytes: int = 0
    linear_bytes: int = 0
    # batch size -> tokens/s of every round.
    rounds: dict[int, list[float]] = field(default_factory=dict)
    error: str = ""

    def best(self, size: int) -> float:
        return max(self.rounds.get(size, [0.0]))

    def median(self, size: int) -> float:
        return statistics.median(self.rounds.get(size, [0.0]))


def weight_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(all parameters and buffers, the linear weights: quantized ones with their scales or the
    float weights of the parallel linears), bytes."""
    from pytgi_shard.quantization.linear_weight import QuantizedWeight

    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    linear = 0
    for module in model.modules():
        if isinstance(module, QuantizedWeight):
            linear += module.nbytes()
        elif type(module).__name__ in ("ColumnParallelLinear", "RowParallelLinear"):
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor):
                linear += weight.numel() * weight.element_size()
    return total, linear


def _warmup(engine, max_batch: int) -> None:  # type: ignore[no-untyped-def]
    tokens = max_batch * (INPUT_LEN + 64)
    engine.warmup(generate_pb2.WarmupRequest(
        max_input_tokens=INPUT_LEN, max_total_tokens=INPUT_LEN + 64,
        max_prefill_tokens=min(tokens, 8192), max_batch_total_tokens=tokens + 64 * 16,
        max_batch_size=max_batch))  # fmt: skip


def load(model_dir: Path, mode: str, dtype: str, max_batch: int):  # type: ignore[no-untyped-def]
    """The shard's engine for `mode` as `pytgi-shard serve --quantize mode` builds it."""
    from pytgi_shard.service.startup import load_engine
    from pytgi_shard.settings import ShardSettings

    quantize = None if mode == "float" else mode
    if mode in EXPORTED:
        model_dir = export(model_dir, model_dir.with_name(f"{model_dir.name}-{mode}"), mode)
        quantize = None
    engine = load_engine(ShardSettings(model_path=model_dir, dtype=dtype, quantize=quantize))
    _warmup(engine, max_batch)
    measure(engine, 1, INPUT_LEN, 2)  # first-call costs, untimed
    return engine


def run_modes(
    model_dir: Path, modes: list[str], dtype: str, sizes: list[int], rounds: int, steps: int
) -> list[ModeResult]:
    results = {m: ModeResult(m) for m in modes}
    engines = {}
    for mode in modes:
        try:
            engines[mode] = load(model_dir, mode, dtype, max(sizes))
        except Exception as error:  # a mode this machine cannot run is reported, not fatal
            results[mode].error = f"{type(error).__name__}: {error}"
            continue
        results[mode].weight_bytes, results[mode].linear_bytes = weight_bytes(engines[mode].model)
    for _ in range(rounds):
        for mode, engine in engines.items():
            for size in sizes:
                row = measure(engine, size, INPUT_LEN, steps)
                results[mode].rounds.setdefault(size, []).append(round(row.tokens_per_s, 1))
    return list(results.values())


def print_table(results: list[ModeResult], sizes: list[int]) -> None:
    base = next((r for r in results if r.mode == "float"), None)
    heads = " | ".join(f"batch {s} tok/s (median) | vs float" for s in sizes)
    print(f"| mode | weights MiB | linears MiB | {heads} |")
    print("|---|---|---|" + "---|---|" * len(sizes))
    for r in results:
        if r.error:
            print(f"| {r.mode} | not run: {r.error} |")
            continue
        cells = []
        for s in sizes:
            ratio = r.best(s) / base.best(s) if base and base.best(s) else float("nan")
            cells.append(f"{r.best(s):,.1f} ({r.median(s):,.1f}) | {ratio:.2f}x")
        print(f"| {r.mode} | {r.weight_bytes / 2**20:.1f} | {r.linear_bytes / 2**20:.1f} | "
              f"{' | '.join(cells)} |")  # fmt: skip


def print_kernels(kernels: list[KernelTime]) -> None:
    sizes = sorted({k.tokens for k in kernels})
    print("\n| kernel (one layer's q|k|v, o, gate|up, down) | "
          + " | ".join(f"{s} tokens us | vs float" for s in sizes) + " |")  # fmt: skip
    print("|---|" + "---|---|" * len(sizes))
    by = {(k.candidate, k.tokens): k for k in kernels}
    for name in dict.fromkeys(k.candidate for k in kernels):
        cells = [f"{by[(name, s)].us:,.1f} | {by[(name, s)].speedup:.2f}x" for s in sizes]
        print(f"| {name} | {' | '.join(cells)} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pytgi_bench.experiments.quantization", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument("--root", type=Path, default=Path("/tmp/pytgi-quant-bench"))
    p.add_argument("--no-kernels", action="store_true", help="skip the kernel table")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    model_dir = build_random_llama(args.root / QUANT_20M.name, QUANT_20M, DEMO_MODEL)
    results = run_modes(model_dir, args.modes.split(","), dtype, sizes, args.rounds, args.steps)
    kernels = [] if args.no_kernels else measure_kernels(
        QUANT_20M, device, getattr(torch, dtype), sizes, rounds=max(args.rounds, 3)
    )  # fmt: skip
    command = "python -m pytgi_bench.experiments.quantization " + shlex.join(argv or sys.argv[1:])
    print(f"# {command}")
    print(f"# {device} ({torch.get_num_threads()} threads), {dtype}, {QUANT_20M}, prompt "
          f"{INPUT_LEN} tokens, {args.steps} decode steps, best of {args.rounds} rounds")  # fmt: skip
    print_table(results, sizes)
    if kernels:
        print_kernels(kernels)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "command": command, "device": str(device), "dtype": dtype,
            "threads": torch.get_num_threads(), "shape": asdict(QUANT_20M),
            "input_len": INPUT_LEN, "steps": args.steps, "rounds": args.rounds,
            "modes": [asdict(r) | {"best": {s: r.best(s) for s in sizes}} for r in results],
            "kernels": [asdict(k) for k in kernels],
        }  # fmt: skip
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

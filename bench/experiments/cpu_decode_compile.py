"""Does torch.compile (inductor's C++ backend) pay for the CPU decode forward? (issue 34)

    python -m pytgi_bench.experiments.cpu_decode_compile --batch-sizes 1,64 --steps 24 \
        --out bench/results/cpu/decode_compile.json

One shard Engine on the demo model, in-process (no router, no gRPC), as
`pytgi_bench.compare.engine_steps` drives it: per batch size, a prefill then `--steps` Decode
calls, medians of the call and of the forward the engine measured. First eager, then with the
model's `forward` replaced by `torch.compile(forward, dynamic=...)`: the first compiled pass is
reported apart (its compile time), then `--repeats` eager/compiled pairs alternate so the
machine's neighbours load both alike. The greedy tokens of the compiled engine are checked
equal to eager's. A probe: nothing here changes the shard.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from pytgi_bench.compare.engine_steps import _batch, _warmup
from pytgi_proto import generate_pb2

DEMO_MODEL = Path(__file__).resolve().parents[2] / "launcher" / "demo_model"


def run(engine: Any, size: int, steps: int) -> tuple[float, float, list[list[int]]]:
    """(median call ms, median forward ms, each step's token ids) for one batch of `size`."""
    batch = _batch(size, size, 32, steps + 2, engine.model.vocab_size, engine.block_size)
    engine.clear(None)
    response = engine.prefill(generate_pb2.PrefillRequest(batch=batch))
    calls, forwards, tokens = [], [], []
    cached = response.batch
    for _ in range(steps):
        start = time.perf_counter()
        response = engine.decode(generate_pb2.DecodeRequest(batches=[cached]))
        calls.append(time.perf_counter() - start)
        forwards.append(response.forward_ns / 1e6)
        tokens.append([g.tokens.ids[0] for g in response.generations])
        cached = response.batch
    engine.clear(None)
    return statistics.median(calls) * 1e3, statistics.median(forwards), tokens


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dynamic", choices=("true", "false"), default="true")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    import torch

    from pytgi_shard.service.startup import load_engine
    from pytgi_shard.settings import ShardSettings

    torch.set_num_threads(args.threads)
    engine = load_engine(ShardSettings(model_path=DEMO_MODEL))
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    _warmup(engine, max(sizes), 32)
    model = engine.runner.model
    eager_forward = model.forward
    compiled_forward = torch.compile(eager_forward, dynamic=args.dynamic == "true")
    result: dict[str, Any] = {"load_average_start": list(os.getloadavg()), "sizes": {}}
    for size in sizes:
        run(engine, size, 4)  # untimed eager: first-call costs
        model.forward = compiled_forward  # type: ignore[method-assign]
        start = time.perf_counter()
        _, _, compiled_tokens = run(engine, size, args.steps)
        first_pass_s = time.perf_counter() - start
        model.forward = eager_forward  # type: ignore[method-assign]
        pairs = []
        for _ in range(args.repeats):
            eager = run(engine, size, args.steps)
            model.forward = compiled_forward  # type: ignore[method-assign]
            compiled = run(engine, size, args.steps)
            model.forward = eager_forward  # type: ignore[method-assign]
            pairs.append({"eager_call_ms": eager[0], "eager_forward_ms": eager[1],
                          "compiled_call_ms": compiled[0], "compiled_forward_ms": compiled[1],
                          "same_tokens": eager[2] == compiled[2] == compiled_tokens})
        med = {k: statistics.median(p[k] for p in pairs) for k in pairs[0] if k.endswith("ms")}
        result["sizes"][size] = {"first_compiled_pass_s": first_pass_s, "pairs": pairs,
                                 "medians": med,
                                 "same_tokens": all(p["same_tokens"] for p in pairs)}
        print(size, json.dumps(result["sizes"][size]["medians"]),
              f"first compiled pass {first_pass_s:.1f} s",
              "same tokens" if result["sizes"][size]["same_tokens"] else "TOKENS DIFFER",
              flush=True)
    result["load_average_end"] = list(os.getloadavg())
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Is Warmup's measured prefill budget right? The whole prefill curve of a device beside the
budget the policy chose from its first rungs.

Warmup (shard/engine/prefill_ladder.py) stops climbing as soon as the policy
(shard/engine/prefill_budget.py) says so: throughput saturated, a step too slow, memory, its time
budget. This measures every rung up to --top whatever the policy says (same batches, the same
fastest-of-3 timing), then replays the policy over the curve: where it stopped, what it chose,
and the chosen rung's throughput against the peak of the whole curve. Run it where a budget
matters (a GPU window: `--model` a bench/compare/build_model.py shape) to check the policy there.

    python -m pytgi_bench.experiments.prefill_ladder [--model launcher/demo_model]
        [--top 32768] [--dtype bfloat16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pytgi_proto import generate_pb2 as pb

REPO = Path(__file__).resolve().parents[2]
DEMO_MODEL = REPO / "launcher" / "demo_model"


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """The full curve and the policy's replay over it."""
    from pytgi_shard.engine.prefill_budget import LadderPolicy, Rung, choose, next_rung
    from pytgi_shard.engine.prefill_ladder import ladder_bounds, measure_rung
    from pytgi_shard.engine.warmup import Limits
    from pytgi_shard.service.startup import load_engine
    from pytgi_shard.settings import ShardSettings

    engine = load_engine(ShardSettings(model_path=Path(args.model), dtype=args.dtype))
    engine.warmup(pb.WarmupRequest(max_prefill_tokens=256, max_batch_total_tokens=4096))
    policy = LadderPolicy()
    limits = Limits(0, 0, 0, 0, 0)
    bounds = ladder_bounds(engine.runner, limits, not engine.encoder_decoder, policy)
    curve: list[Rung] = []
    tokens = policy.first_rung
    while tokens <= min(args.top, bounds.ceiling):
        rung = measure_rung(engine.runner, limits, tokens, engine._run_warmup_batch, policy,
                            warm=not curve)
        engine.runner.resize_kv_cache(1)
        if rung is None:
            break
        curve.append(rung)
        tokens *= 2
    seen: list[Rung] = []
    step = next_rung(seen, bounds, policy)
    while step.tokens is not None and len(seen) < len(curve) and step.tokens == curve[len(seen)].tokens:
        seen.append(curve[len(seen)])
        step = next_rung(seen, bounds, policy)
    stopped = step.why or "the curve's end"
    choice = choose(seen, bounds, policy, stopped)
    peak = max(curve, key=lambda r: r.throughput)
    chosen = next(r for r in curve if r.tokens == min(choice.tokens, curve[-1].tokens))
    return {
        "model": str(args.model), "device": str(engine.model.device),
        "curve": [asdict(r) | {"tokens_per_s": r.throughput} for r in curve],
        "policy_measured": [r.tokens for r in seen], "policy_stopped": stopped,
        "chosen": choice.tokens, "why": choice.why,
        "chosen_share_of_curve_peak": chosen.throughput / peak.throughput,
        "curve_peak": {"tokens": peak.tokens, "tokens_per_s": peak.throughput},
    }


def print_table(result: dict[str, Any]) -> None:
    print(f"{result['model']} on {result['device']}")
    print(f"{'tokens':>7} {'step ms':>9} {'tok/s':>9} {'peak MiB':>9}")
    for r in result["curve"]:
        mark = " <- chosen" if r["tokens"] == result["chosen"] else ""
        print(f"{r['tokens']:>7} {r['seconds'] * 1e3:>9.1f} {r['tokens_per_s']:>9.0f} "
              f"{r['peak_bytes'] / 2**20:>9.0f}{mark}")
    print(f"policy measured {result['policy_measured']} (stopped: {result['policy_stopped']}); "
          f"chose {result['chosen']}: {result['chosen_share_of_curve_peak']:.0%} of the curve's "
          f"peak ({result['curve_peak']['tokens_per_s']:.0f} tok/s at "
          f"{result['curve_peak']['tokens']})")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEMO_MODEL))
    p.add_argument("--top", type=int, default=32_768, help="largest rung of the curve")
    p.add_argument("--dtype", default=None, help="float16 | bfloat16 | float32 (the shard's)")
    p.add_argument("--json", type=Path, help="write the result here too")
    args = p.parse_args(argv)
    result = measure(args)
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

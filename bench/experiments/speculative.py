"""Speculative decoding with n-gram drafts (--speculate): the demo model's greedy throughput with
--speculate 4 against 0, in one process, through the shard's Engine (Prefill, then Decode to the
end, as the router drives it; KV blocks for each whole sequence up front).

    python -m pytgi_bench.experiments.speculative --out bench/results/cpu/speculative.json
    python -m pytgi_bench.experiments.speculative --temperature 0.7 --workloads "batch 1" \
        --out bench/results/cpu/speculative_sampling.json

Workloads (greedy, or with --temperature T seeded sampling; EOS ignored; every output checked
equal between the two engines, seeded sampling included):
- quoting, batch 1: a passage, then its first line again: the model goes on quoting it (what
  RAG answers, summaries and code edits do), and drafts are kept;
- fresh, batch 1: a speaker's cue and a line the model has not seen in the prompt, 48 tokens
  (this small model falls into loops after a few lines, which drafts then catch);
- fresh short, batch 1: the same prompts, 12 tokens: before its loops, where drafts come from
  2..4-token matches that mostly miss (the cost of speculating where it does not pay);
- mixed, batch 2 / 4 / 16: both kinds, that many at once (drafting.DRAFTING_BATCH is 2: the
  larger ones take the plain step; run with the cap raised to see what drafting would cost);
- batch 64: 64 of both kinds at once.
With --draft, the speculating engine drafts with a draft model (--speculator-model) instead
of n-gram lookup, on the workloads that draft (batch 1 and 2; larger batches never draft):
- `--draft self`: the demo model as its own draft (every draft kept: the machinery's cost at
  full acceptance, each draft costing a forward of the target itself);
- `--draft layers:N`: a draft made of the demo model's first N of 6 layers, its final norm and
  LM head (a self-speculative early exit: no training, the same tokenizer, N/6 of the cost);
- `--draft DIR`: any model directory with the demo model's tokenizer.

    python -m pytgi_bench.experiments.speculative --draft layers:2 \
        --out bench/results/cpu/speculative_draft_model.json

Each batch is served by both engines back to back, the order alternating, --repeats times,
after one untimed run of each (a process's first verification forward pays one-time costs);
the speedup is the median over repeats of the two times' ratio (both engines saw the same load
on a shared host), tokens/s the generated tokens over the median time.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.engine import drafting
from pytgi_shard.engine.drafting import DRAFTING_BATCH, STEP_TOKENS
from pytgi_shard.engine.engine import Engine
from pytgi_shard.engine.verify_graphs import most_verified_tokens
from pytgi_shard.service.startup import load_engine
from pytgi_shard.settings import ShardSettings

REPO = Path(__file__).resolve().parents[2]
DEMO_MODEL = REPO / "launcher" / "demo_model"
PASSAGES = (
    "ROMEO:\nBut soft, what light through yonder window breaks?\nIt is the east, and Juliet "
    "is the sun.\nArise, fair sun, and kill the envious moon,\n",
    "HAMLET:\nTo be, or not to be, that is the question:\nWhether 'tis nobler in the mind to "
    "suffer\nThe slings and arrows of outrageous fortune,\n",
    "KING HENRY:\nOnce more unto the breach, dear friends, once more;\nOr close the wall up "
    "with our English dead.\nIn peace there's nothing so becomes a man\n",
    "MACBETH:\nTomorrow, and tomorrow, and tomorrow,\nCreeps in this petty pace from day to "
    "day,\nTo the last syllable of recorded time;\n",
)
FRESH = (
    "PORTIA:\nThe quality of mercy is not strained;",
    "JULIUS CAESAR:\nCowards die many times before their deaths;",
    "PROSPERO:\nWe are such stuff as dreams are made on,",
    "OTHELLO:\nHer father loved me, oft invited me,",
)


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    prompts: list[str]
    max_new: int
    # Requests served at once: 1 serves the prompts one after the other.
    batch: int


def workloads() -> list[Workload]:
    quoting = [p + "\n" + p.split("\n")[0] + "\n" + p.split("\n")[1][:12] for p in PASSAGES]
    mixed = [(quoting + list(FRESH))[i % 8] for i in range(64)]
    return [
        Workload("quoting, batch 1", quoting, 96, 1),
        Workload("fresh, batch 1", list(FRESH), 48, 1),
        Workload("fresh short, batch 1", list(FRESH), 12, 1),
        Workload("mixed, batch 2", mixed[:8], 48, 2),
        Workload("mixed, batch 4", mixed[:8], 48, 4),
        Workload("mixed, batch 16", mixed[:16], 48, 16),
        Workload("batch 64", mixed, 48, 64),
    ]


def engine(speculate: int, draft: Path | None = None, model: Path = DEMO_MODEL) -> Engine:
    """An engine of `model` (on a GPU: CUDA graphs for the workloads' batch sizes, and the token
    counts of a verification step of one and of two drafting rows, which replay the decode
    graphs as one row per token: few graphs keep two engines of a large model quick to warm
    up side by side)."""
    verifying = {1 + speculate, most_verified_tokens(speculate)} if speculate else set()
    out = load_engine(ShardSettings(
        model_path=model, speculate=speculate, speculator_model=draft,
        cuda_graphs=tuple(sorted({w.batch for w in workloads()} | verifying)),
    ))
    out.warmup(pb.WarmupRequest(max_prefill_tokens=4096, max_batch_total_tokens=256 * 96,
                                max_input_tokens=200, max_total_tokens=256))
    return out


@dataclass(slots=True)
class Result:
    tokens: dict[int, list[int]]
    seconds: float
    steps: int
    drafted: int
    kept: int
    drafting_rows: int


def serve(e: Engine, prompts: list[str], max_new: int, temperature: float = 0.0) -> Result:
    """Every prompt at once (one Prefill), then Decode until all are done; greedy, or sampling
    at `temperature` (> 0) seeded by the prompt's place in the batch."""
    reqs = []
    block = 1
    for i, text in enumerate(prompts):
        ids = e.detokenizer.tokenizer.encode(text).ids
        count = -(-(len(ids) + max_new) // e.block_size)
        params = pb.NextTokenChooserParameters(
            do_sample=True, temperature=temperature, seed=1000 + i) if temperature else None
        reqs.append(pb.Request(
            id=i, input_ids=ids, blocks=list(range(block, block + count)), parameters=params,
            stopping_parameters=pb.StoppingCriteriaParameters(
                max_new_tokens=max_new, ignore_eos_token=True),
        ))
        block += count
    start = time.perf_counter()
    response = e.prefill(pb.PrefillRequest(batch=pb.Batch(id=1, requests=reqs, size=len(reqs))))
    tokens = {g.request_id: list(g.tokens.ids) for g in response.generations}
    cached = response.batch if response.HasField("batch") else None
    steps = drafted = rows = kept = 0
    while cached is not None:
        step = e.decode(pb.DecodeRequest(batches=[cached]))
        steps += 1
        drafted += step.drafted_tokens
        rows += step.drafted_rows
        for g in step.generations:
            tokens[g.request_id].extend(g.tokens.ids)
            kept += len(g.tokens.ids) - 1
        cached = step.batch if step.HasField("batch") else None
    return Result(tokens, time.perf_counter() - start, steps, drafted, kept, rows)


def combine(parts: list[Result], batch: int) -> Result:
    """The results of a workload's batches (served one after the other) as one."""
    tokens = {}
    for i, part in enumerate(parts):
        tokens.update({i * batch + rid: t for rid, t in part.tokens.items()})
    return Result(
        tokens, sum(p.seconds for p in parts), sum(p.steps for p in parts),
        sum(p.drafted for p in parts), sum(p.kept for p in parts),
        sum(p.drafting_rows for p in parts),
    )


def measure(plain: Engine, speculating: Engine, w: Workload, repeats: int,
            temperature: float = 0.0) -> dict[str, object]:
    """Each batch of the workload served by both engines back to back (the order alternating
    from repeat to repeat), so that both see the same load on a shared host; per repeat the
    ratio of their times, the median of those ratios reported."""
    batches = [w.prompts[i : i + w.batch] for i in range(0, len(w.prompts), w.batch)]
    for e in (plain, speculating):
        serve(e, batches[0], w.max_new, temperature)
    runs: dict[int, list[Result]] = {0: [], 4: []}
    for rep in range(repeats):
        parts: dict[int, list[Result]] = {0: [], 4: []}
        for prompts in batches:
            order = ((0, plain), (4, speculating))
            for k, e in order if rep % 2 == 0 else order[::-1]:
                parts[k].append(serve(e, prompts, w.max_new, temperature))
        for k in parts:
            runs[k].append(combine(parts[k], w.batch))
    base, spec = runs[0][0], runs[4][0]
    # Seeded sampling draws each token's numbers from (seed, index): the same tokens too.
    if base.tokens != spec.tokens:
        raise AssertionError(f"{w.name}: --speculate 4 changed the tokens")
    generated = sum(len(t) for t in base.tokens.values())
    ratios = sorted(b.seconds / s.seconds for b, s in zip(runs[0], runs[4], strict=True))
    t0 = statistics.median(r.seconds for r in runs[0])
    t4 = statistics.median(r.seconds for r in runs[4])
    return {
        "workload": w.name,
        "requests": len(w.prompts),
        "batch": w.batch,
        "generated_tokens": generated,
        "tokens_per_s_speculate_0": round(generated / t0, 1),
        "tokens_per_s_speculate_4": round(generated / t4, 1),
        "speedup": round(statistics.median(ratios), 3),
        "speedup_per_repeat": [round(r, 3) for r in ratios],
        "decode_steps_0": base.steps,
        "decode_steps_4": spec.steps,
        "drafted_tokens": spec.drafted,
        "kept_tokens": spec.kept,
        "acceptance_rate": round(spec.kept / spec.drafted, 3) if spec.drafted else None,
        # Tokens emitted per row-step that carried drafts (kept drafts + 1).
        "mean_accepted_length": round((spec.kept + spec.drafting_rows) / spec.drafting_rows, 2)
        if spec.drafting_rows else None,
    }


def draft_model(spec: str, workdir: Path, target: Path) -> Path:
    """The draft model directory --draft names (the module's docstring) for `target`."""
    if spec == "self":
        return target
    if not spec.startswith("layers:"):
        return Path(spec)
    from safetensors.torch import load_file, save_file

    layers = int(spec.split(":", 1)[1])
    out = workdir / f"first-{layers}-layers"
    out.mkdir()
    for f in target.iterdir():
        if f.suffix == ".json" and f.name != "config.json" and "index" not in f.name:
            shutil.copy(f, out / f.name)
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    kept = {}
    for f in sorted(target.glob("*.safetensors")):
        kept.update({name: t for name, t in load_file(f).items()
                     if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers})
    save_file(kept, out / "model.safetensors", metadata={"format": "pt"})
    return out


def back_off(text: str) -> drafting.BackOff:
    """--sampling-back-off's MISSES,FIRST,LONGEST."""
    misses, first, longest = (int(v) for v in text.split(","))
    return drafting.BackOff(misses, first, longest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: steadier on a shared host)")
    parser.add_argument("--drafting-batch", type=int, default=DRAFTING_BATCH,
                        help="the largest batch that drafts (the engine's cap)")
    parser.add_argument("--draft", help="draft with a draft model: self, layers:N or a "
                        "directory (default: n-gram lookup)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sample at this temperature, seeded per request (0: greedy)")
    parser.add_argument("--workloads", help="only the workloads whose name ends with this "
                        "(\"batch 1\": the three at batch 1)")
    parser.add_argument("--model", type=Path, default=DEMO_MODEL,
                        help="the target model's directory (default: the demo model)")
    parser.add_argument("--sampling-back-off", type=back_off, default=drafting.SAMPLING_BACK_OFF,
                        help="a sampling row's back-off, MISSES,FIRST,LONGEST "
                        "(drafting.SAMPLING_BACK_OFF; 2,4,64: the greedy rows' rule)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    # The speculating engine's back-off (read by drafting.back_off at each record).
    drafting.SAMPLING_BACK_OFF = args.sampling_back_off
    rule = args.sampling_back_off
    torch.set_num_threads(args.threads)
    workdir = Path(tempfile.mkdtemp())
    draft = draft_model(args.draft, workdir, args.model) if args.draft else None
    plain, speculating = engine(0, model=args.model), engine(4, draft, args.model)
    speculating.drafting_batch = args.drafting_batch
    chosen = [w for w in workloads() if (draft is None or w.batch <= args.drafting_batch)
              and (args.workloads is None or w.name.endswith(args.workloads))]
    rows = [measure(plain, speculating, w, args.repeats, args.temperature) for w in chosen]
    shutil.rmtree(workdir)
    for row in rows:
        print(f"{row['workload']:<18} {row['tokens_per_s_speculate_0']:>8} -> "
              f"{row['tokens_per_s_speculate_4']:>8} tok/s  x{row['speedup']}  "
              f"steps {row['decode_steps_0']} -> {row['decode_steps_4']}  "
              f"accepted length {row['mean_accepted_length']}")
    report = {
        "command": "python -m pytgi_bench.experiments.speculative --repeats "
                   f"{args.repeats} --threads {args.threads} --drafting-batch "
                   f"{args.drafting_batch}" + (f" --draft {args.draft}" if args.draft else "")
                   + (f" --temperature {args.temperature}" if args.temperature else "")
                   + (f" --workloads '{args.workloads}'" if args.workloads else "")
                   + (f" --sampling-back-off {rule.misses},{rule.first},{rule.longest}"
                      if args.temperature else "")
                   + (f" --model {args.model}" if args.model != DEMO_MODEL else ""),
        "sampling": f"temperature {args.temperature}, seeded" if args.temperature else "greedy",
        "model": str(args.model.relative_to(REPO) if args.model.is_relative_to(REPO)
                     else args.model),
        "drafter": f"draft model: {args.draft}" if args.draft else "n-gram",
        "device": (torch.cuda.get_device_name(plain.model.device)
                   if plain.model.device.type == "cuda" else "cpu"),
        "torch_threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "step_tokens": STEP_TOKENS,
        "drafting_batch": args.drafting_batch,
        "sampling_back_off": {"misses": rule.misses, "first_pause": rule.first,
                              "longest_pause": rule.longest},
        "results": rows,
    }
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""Structured output at full speed: a batch of 64 constrained requests against the same batch
unconstrained, on the CPU, through the shard's Engine in-process (no router, no gRPC).

    python -m pytgi_bench.experiments.grammar --out bench/results/cpu/grammar.json

The model is a random 4-layer Llama (hidden 256, the "cpu-small" shape) over a 128,256-token
byte-level BPE vocabulary (Llama 3's size, trained offline by bench/experiments/grammar_libraries.py), so
every step masks 64 x 128k logits; `--tokenizer-source launcher/demo_model` takes the demo
model's 4,096-token vocabulary instead. Each constrained request follows a JSON schema: an array of
20-property objects (bench/grammar_libraries.SCHEMA_20), at least 100 of them, so that no
request completes it within --new-tokens. The same 64 prompts run unconstrained
and constrained in alternating rounds; tokens/s counts generated tokens over the Prefill and
every Decode. A second constrained batch with the same schema must compile nothing (the
compiler's cache counts hits and misses). The breakdown says where a constrained step's extra
time goes: in the grammar thread (tokens consumed, llguidance's masks) and on the engine's
thread (hand-off, waiting for the masks, the words to the bias, with the fraction of steps whose
rows shared masks enough to make the bias per run of rows: shard/structured_output/masks.py); then, timed
apart on a batch of 64 distinct random masks, the words to a per-row bias, its add to the
logits, and the plain masked fill by a bool it replaces.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pytgi_bench.compare.model_builder import LlamaShape, build_random_llama
from pytgi_bench.experiments.grammar_libraries import SCHEMA_20, build_tokenizer
from pytgi_proto import generate_pb2 as pb

SHAPE = LlamaShape("grammar-cpu-small-128k", 256, 768, 4, 4, 2)
# At least 100 objects: no request can complete it within --new-tokens, so both batches keep
# all 64 rows for the same number of steps.
SCHEMA: dict[str, Any] = {"type": "array", "items": SCHEMA_20, "minItems": 100}
FIRST_PLAIN_ID = 3


def build_model(root: Path, tokenizer_source: Path | None = None) -> Path:
    """The random Llama over the 128k vocabulary, or over `tokenizer_source`'s (built once
    under `root`)."""
    if tokenizer_source is not None:
        return build_random_llama(root / f"grammar-{tokenizer_source.name}", SHAPE, tokenizer_source)
    source = root / "bpe-128k"
    if not (source / "tokenizer.json").is_file():
        source.mkdir(parents=True, exist_ok=True)
        build_tokenizer(source / "tokenizer.json")
        (source / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
            "eos_token": "</s>", "pad_token": "<pad>",
        }))  # fmt: skip
    return build_random_llama(root / SHAPE.name, SHAPE, source)


def row_schema(row: int, distinct: bool) -> dict[str, Any]:
    """The bench's schema, or with --distinct-schemas one per row: every property name prefixed
    by the row's number (`r7_id`), so that rows writing a property name have their own mask."""
    if not distinct:
        return SCHEMA
    rename = {name: f"r{row}_{name}" for name in SCHEMA_20["properties"]}
    items = {**SCHEMA_20,
             "properties": {rename[k]: v for k, v in SCHEMA_20["properties"].items()},
             "required": [rename[k] for k in SCHEMA_20["required"]]}  # fmt: skip
    return {**SCHEMA, "items": items}


def batch(batch_id: int, size: int, input_len: int, new_tokens: int, vocab: int, block: int,
          constrained: bool, distinct: bool = False, temperature: float = 0.0) -> pb.Batch:  # fmt: skip
    per = math.ceil((input_len + new_tokens) / block)
    requests = []
    for i in range(size):
        params = pb.NextTokenChooserParameters()
        if temperature > 0:
            params.do_sample, params.temperature, params.seed = True, temperature, i
        if constrained:
            params.grammar = json.dumps(row_schema(i, distinct))
            params.grammar_type = pb.GRAMMAR_TYPE_JSON
        requests.append(pb.Request(
            id=i,
            input_ids=[FIRST_PLAIN_ID + (7 * i + 13 * j) % (vocab - FIRST_PLAIN_ID)
                       for j in range(input_len)],
            parameters=params,
            stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=new_tokens),
            blocks=list(range(1 + i * per, 1 + (i + 1) * per)),
        ))  # fmt: skip
    return pb.Batch(id=batch_id, requests=requests, size=size)


def run(engine: Any, request: pb.Batch) -> dict[str, Any]:
    """Prefill then Decode until every request finished: tokens, seconds, early finishes. The
    constrained requests' matchers are prepared first, off the clock, as the router's
    PrepareGrammar has them built before it schedules a request."""
    prepared = [
        engine.prepare_grammar(pb.PrepareGrammarRequest(
            grammar=r.parameters.grammar, grammar_type=r.parameters.grammar_type))
        for r in request.requests if r.parameters.grammar
    ]  # fmt: skip
    for future in prepared:
        future.result()
    start = time.perf_counter()
    response = engine.prefill(pb.PrefillRequest(batch=request))
    tokens = len(response.generations)
    finished = [g for g in response.generations if g.HasField("generated_text")]
    cached = response.batch if response.HasField("batch") else None
    decode_start = time.perf_counter()
    steps = 0
    while cached is not None:
        out = engine.decode(pb.DecodeRequest(batches=[cached]))
        tokens += len(out.generations)
        finished += [g for g in out.generations if g.HasField("generated_text")]
        cached = out.batch if out.HasField("batch") else None
        steps += 1
    end = time.perf_counter()
    max_new = request.requests[0].stopping_parameters.max_new_tokens
    return {
        "seconds": end - start,
        "tokens": tokens,
        "tokens_per_s": tokens / (end - start),
        "decode_ms_per_step": (end - decode_start) * 1e3 / max(steps, 1),
        "ended_before_max_new_tokens": sum(
            g.generated_text.generated_tokens < max_new for g in finished
        ),
        "example": finished[0].generated_text.text[:160] if finished else "",
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from pytgi_shard.service.startup import load_engine
    from pytgi_shard.settings import ShardSettings

    model = build_model(args.root, args.tokenizer_source)
    settings = ShardSettings(model_path=model, block_size=args.block, overlap=args.overlap,
                             grammar_thread=args.grammar_thread)
    engine = load_engine(settings)
    total = args.batch * (args.input_len + args.new_tokens)
    engine.warmup(pb.WarmupRequest(max_prefill_tokens=args.batch * args.input_len,
                                   max_batch_total_tokens=total + args.block * args.batch))
    vocab = engine.model.vocab_size
    compiler = engine.grammars
    cold = _cold_compile_ms(engine)

    def one(batch_id: int, constrained: bool) -> dict[str, Any]:
        return run(engine, batch(batch_id, args.batch, args.input_len, args.new_tokens, vocab,
                                 args.block, constrained, args.distinct_schemas,
                                 args.temperature))  # fmt: skip

    one(1, False)  # warm: first-touch allocations, thread pools
    first = (compiler.stats.hits, compiler.stats.misses)
    one(2, True)
    after_first = (compiler.stats.hits, compiler.stats.misses)
    rounds: dict[str, list[dict[str, Any]]] = {"unconstrained": [], "constrained": []}
    timings = compiler.worker.timings
    timings.reset()
    for r in range(args.rounds):
        rounds["unconstrained"].append(one(10 + 2 * r, False))
        rounds["constrained"].append(one(11 + 2 * r, True))
    after_second = (compiler.stats.hits, compiler.stats.misses)
    breakdown = {**timings.per_step_ms(), **_apply_ms(args.batch, vocab)}
    summary = {k: _median(v) for k, v in rounds.items()}
    ratio = summary["constrained"]["tokens_per_s"] / summary["unconstrained"]["tokens_per_s"]
    return {
        "batch": args.batch, "input_len": args.input_len, "new_tokens": args.new_tokens,
        "vocab": vocab, "temperature": args.temperature, "overlap": engine.overlap,
        "grammar_thread": not compiler.worker.inline, "rounds": rounds, "median": summary,
        "constrained_over_unconstrained": round(ratio, 3),
        "compile_cold_ms": round(cold, 2),
        "breakdown_ms_per_step": breakdown,
        "cache": {
            "first_batch": {"hits": after_first[0] - first[0], "misses": after_first[1] - first[1]},
            "later_batches": {"hits": after_second[0] - after_first[0],
                              "misses": after_second[1] - after_first[1]},
        },
    }  # fmt: skip


def _cold_compile_ms(engine: Any) -> float:
    """The schema compiled by a fresh compiler over the engine's vocabulary (no cache)."""
    from pytgi_shard.structured_output.compiler import GrammarCompiler, GrammarSpec
    from pytgi_shard.structured_output.worker import MaskWorker

    detokenizer = engine.detokenizer
    fresh = GrammarCompiler(detokenizer.tokenizer.to_str(), engine.model.vocab_size,
                            sorted(detokenizer.eos_ids), MaskWorker())  # fmt: skip
    assert fresh.tokenizer is not None  # prepared before the clock starts
    spec = GrammarSpec(pb.GRAMMAR_TYPE_JSON, json.dumps(SCHEMA))
    start = time.perf_counter()
    fresh.take(spec)
    elapsed = (time.perf_counter() - start) * 1e3
    fresh.worker.shutdown()
    return elapsed


def _apply_ms(rows: int, vocab: int, repeats: int = 20) -> dict[str, float]:
    """The engine thread's cost of a batch of distinct masks (median of `repeats`): the words
    to the per-row bias (no rows sharing a mask), the bias add sampling does, and the masked
    fill by a bool it replaced."""
    import torch

    from pytgi_shard.sample.chooser import NEG_INF, ban_tokens
    from pytgi_shard.structured_output.masks import HostBias

    g = torch.Generator().manual_seed(0)
    scores = torch.randn(rows, vocab, generator=g)
    words = torch.randint(-(2**31), 2**31 - 1, (rows, (vocab + 31) // 32), generator=g)
    words = words.to(torch.int32)
    host = HostBias()
    bias = host(words, vocab).clone()
    banned = bias == NEG_INF

    def median_ms(run: Callable[[], object]) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return round(statistics.median(times) * 1e3, 3)

    return {
        "convert_distinct_rows_ms": median_ms(lambda: host(words, vocab)),
        "apply_bias_ms": median_ms(lambda: ban_tokens(scores, None, bias)),
        "apply_bool_masked_fill_ms": median_ms(lambda: ban_tokens(scores, None, banned)),
    }


def _median(rows: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("seconds", "tokens", "tokens_per_s", "decode_ms_per_step", "ended_before_max_new_tokens")
    return {k: round(statistics.median(r[k] for r in rows), 3) for k in keys}


def table(result: dict[str, Any]) -> str:
    m = result["median"]
    lines = ["| batch 64, CPU | tokens/s | decode ms/step | tokens | ended early |",
             "|---|---|---|---|---|"]
    for name in ("unconstrained", "constrained"):
        r = m[name]
        lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['decode_ms_per_step']:.1f} | "
                     f"{r['tokens']:.0f} | {r['ended_before_max_new_tokens']:.0f} |")
    cache = result["cache"]
    lines.append(f"\nconstrained / unconstrained: {result['constrained_over_unconstrained']}x "
                 f"(target >= 0.9); schema compiled cold in {result['compile_cold_ms']} ms; "
                 f"first constrained batch: {cache['first_batch']}; every later batch with the "
                 f"same schema: {cache['later_batches']}")  # fmt: skip
    lines.append("breakdown of a constrained step (ms): " + ", ".join(
        f"{k.removesuffix('_ms')} {v}" for k, v in result["breakdown_ms_per_step"].items()))  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=Path("build/bench-models"))
    parser.add_argument("--tokenizer-source", type=Path, default=None,
                        help="a model directory whose tokenizer to use instead of the 128k BPE")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--distinct-schemas", action="store_true",
                        help="each request its own schema (property names prefixed by its row), "
                             "so rows rarely share a mask")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="every request samples at this temperature (seeded per row); "
                             "0: greedy")
    parser.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--grammar-thread", action=argparse.BooleanOptionalAction, default=None,
                        help="the shard's setting (default: inline on the CPU)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    result = measure(args)
    command = "python -m pytgi_bench.experiments.grammar " + shlex.join(argv if argv is not None else sys.argv[1:])
    result["command"] = command
    print(command)
    print(table(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

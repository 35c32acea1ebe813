"""--kv-cache-dtype: what an FP8 KV cache costs in quality and, on the CPU's reference path, in
speed.

    python -m pytgi_bench.experiments.kv_cache_fp8 [--threads N] [--rounds 5] [--out PATH]

Quality: the trained demo model's (launcher/demo_model) perplexity on held-out Shakespeare
(tests/e2e/shakespeare_heldout.txt, the text issue 17's quantization bound is measured on), from
the prompt logprobs a real `pytgi-launcher` serves (decoder_input_details), once per cache dtype:
the model's float32, fp8_e4m3fn and fp8_e5m2 (scales 1.0: the demo checkpoint has none). Each
prompt's keys and values are written to the cache and read back from it by its own prefill, so
the logprobs see the FP8 rounding of every layer's K/V.

Speed: the reference backend (plain PyTorch, the CPU path) on an 8B-shaped layer (32 query heads,
8 KV heads, head_dim 128, blocks of 16): a decode step of 16 requests over 1,024 tokens of
context each, and a 512-token prefill chunk after 512 cached tokens, with the cache in float32
and in each FP8 format, in rotation (every case once per round); the best of `--rounds` is
reported, the median beside it. `--skip-served` measures the speed rows alone.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import torch
from tokenizers import Tokenizer

from pytgi_bench.compare.server_process import PytgiServer
from pytgi_shard.attention.kv_quant import KVScales
from pytgi_shard.attention.metadata import AttentionMetadata
from pytgi_shard.attention.reference import ReferenceAttention

ROOT = Path(__file__).resolve().parents[2]
DEMO_MODEL = ROOT / "launcher" / "demo_model"
HELD_OUT = ROOT / "tests" / "e2e" / "shakespeare_heldout.txt"
CACHE_DTYPES: list[str | None] = [None, "fp8_e4m3fn", "fp8_e5m2"]
TORCH_DTYPES = {None: torch.float32, "fp8_e4m3fn": torch.float8_e4m3fn,
                "fp8_e5m2": torch.float8_e5m2}
CHUNK_TOKENS = 200


def chunks(text: str, tokenizer: Tokenizer, limit: int) -> list[str]:
    """Whole lines, as many as fit in `limit` tokens per chunk (the demo model's context is 256)."""
    out, current = [], ""
    for line in text.splitlines(keepends=True):
        if current and len(tokenizer.encode(current + line).ids) > limit:
            out.append(current)
            current = ""
        current += line
    return [*out, current]


def served_perplexity(kv_cache_dtype: str | None, texts: list[str], log_dir: Path) -> float:
    """The perplexity of `texts` from the prompt logprobs a launcher with this cache serves."""
    extra = [] if kv_cache_dtype is None else ["--kv-cache-dtype", kv_cache_dtype]
    total, count = 0.0, 0
    server = PytgiServer(DEMO_MODEL, log_dir / f"{kv_cache_dtype}.log", extra_args=extra)
    with server, httpx.Client(base_url=server.url, timeout=300) as client:
        for text in texts:
            response = client.post("/generate", json={"inputs": text, "parameters": {
                "max_new_tokens": 1, "details": True, "decoder_input_details": True}})  # fmt: skip
            response.raise_for_status()
            logprobs = [t["logprob"] for t in response.json()["details"]["prefill"][1:]]
            total += sum(logprobs)
            count += len(logprobs)
    return math.exp(-total / count)


def _layer_case(
    dtype: torch.dtype, cached: int, new: int, requests: int
) -> tuple[Callable[[], torch.Tensor], int]:
    """One attention layer's forward over a paged batch, the cache in `dtype`; its token count."""
    heads, kv_heads, head_dim, block = 32, 8, 128, 16
    per_request = -(-(cached + new) // block)
    tables = [list(range(1 + i * per_request, 1 + (i + 1) * per_request)) for i in range(requests)]
    meta = AttentionMetadata.build([new] * requests, [cached] * requests, tables, block,
                                   torch.device("cpu"))
    shape = (1 + requests * per_request, block, kv_heads, head_dim)
    caches = [torch.randn(shape).to(dtype) for _ in range(2)]
    q = torch.randn(requests * new, heads, head_dim)
    k, v = torch.randn(2, requests * new, kv_heads, head_dim)
    scales = None if dtype == torch.float32 else KVScales.of(1.0, 1.0, torch.device("cpu"))
    backend = ReferenceAttention()

    def run() -> torch.Tensor:
        fresh = AttentionMetadata(meta.is_prefill, meta.cu_seqlens_q, meta.seqlens_k,
                                  meta.slot_mapping, meta.block_tables, meta.max_seqlen_q,
                                  meta.max_seqlen_k, meta.block_size)
        return backend.forward(q, k, v, caches[0], caches[1], fresh, head_dim**-0.5,
                               kv_scales=scales)

    return run, requests * new


def layer_times(rounds: int) -> dict[tuple[str, str], list[float]]:
    """Milliseconds of one layer's attention (cache write included) per (cache dtype, kind), in
    rotation: each round runs every case once, so load from other work falls on all alike."""
    cases = {}
    for name in CACHE_DTYPES:
        dtype = TORCH_DTYPES[name]
        cases[(name or "float32", "decode")] = _layer_case(dtype, 1024, 1, 16)[0]
        cases[(name or "float32", "prefill")] = _layer_case(dtype, 512, 512, 1)[0]
    times: dict[tuple[str, str], list[float]] = {key: [] for key in cases}
    for run in cases.values():
        run()
    for _ in range(rounds):
        for key, run in cases.items():
            start = time.perf_counter()
            run()
            times[key].append((time.perf_counter() - start) * 1e3)
    return times


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=None, help="torch threads for the speed rows")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON")
    p.add_argument("--skip-served", action="store_true", help="the speed rows only")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = Tokenizer.from_file(str(DEMO_MODEL / "tokenizer.json"))
    texts = chunks(HELD_OUT.read_text(), tokenizer, CHUNK_TOKENS)
    results: dict[str, dict[str, float]] = {name or "float32": {} for name in CACHE_DTYPES}
    with tempfile.TemporaryDirectory() as logs:
        for name in [] if args.skip_served else CACHE_DTYPES:
            results[name or "float32"]["perplexity"] = served_perplexity(name, texts, Path(logs))
    for (name, kind), times in layer_times(args.rounds).items():
        results[name][f"{kind}_ms_best"] = min(times)
        results[name][f"{kind}_ms_median"] = statistics.median(times)
    base = results["float32"]
    print(f"$ python -m pytgi_bench.experiments.kv_cache_fp8 {shlex.join(sys.argv[1:])}")
    print(f"threads {torch.get_num_threads()}; held-out text: {len(texts)} prompts")
    print("| KV cache | perplexity | vs float32 | decode layer ms (best/median) | "
          "prefill layer ms (best/median) |")
    print("| --- | --- | --- | --- | --- |")
    for name, row in results.items():
        ppl = row.get("perplexity", math.nan)
        change = ppl / base.get("perplexity", math.nan) - 1
        print(f"| {name} | {ppl:.3f} | {change:+.2%} | "
              f"{row['decode_ms_best']:.2f} / {row['decode_ms_median']:.2f} | "
              f"{row['prefill_ms_best']:.2f} / {row['prefill_ms_median']:.2f} |")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()

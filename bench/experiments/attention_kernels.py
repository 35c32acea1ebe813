"""Attention kernel timing on CUDA: the Triton backend against the reference, 8B-model shapes.

Llama-3-8B's attention per layer: 32 query heads, 8 KV heads, head_dim 128, bf16, blocks of 16.
Decode rows time one layer's forward (cache write + attention, one token per request) replayed
from a CUDA graph, as the engine runs decode, at batch 1/16/64/256 over 512- and 2048-token
contexts, and report the KV bytes read per second. Prefill rows (eager, back-to-back calls) time
new prompts, and a chunk over a cached prefix, and report causal TFLOP/s; for scale they also time
PyTorch's SDPA (flash) on the same tokens laid out densely, which needs no block table.
`--sweep` also times every decode split count (to check the split rule) and the prefill kernel
alone under several tile configurations (to check prefill_config).

    python -m pytgi_bench.experiments.attention_kernels [--sweep] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from pytgi_shard.attention import AttentionBackend, AttentionMetadata, get_backend
from pytgi_shard.attention.plans import AttentionPlans

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


@dataclass(slots=True)
class Row:
    kind: str
    batch: int
    new_tokens: int
    context: int
    backend: str
    ms: float
    # Decode: GB/s of K/V read; prefill: causal TFLOP/s.
    rate: float


def time_ms(fn: Callable[[], object], graph: bool = False, reps: int = 10,
            samples: int = 15) -> float:
    """Median over `samples` of the mean time of `reps` back-to-back calls (CUDA events).

    With `graph`, fn is captured once in a CUDA graph and the replays are timed, as the engine
    runs decode steps; else the calls are launched eagerly, as it runs prefills.
    """
    for _ in range(3):
        fn()  # compiles, plans, autotuning
    torch.cuda.synchronize()
    run = fn
    if graph:
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            fn()
        run = cuda_graph.replay
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return sorted(times)[len(times) // 2]


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    meta: AttentionMetadata


def make_inputs(batch: int, new: int, cached: int, seed: int = 0) -> Inputs:
    """A batch of `batch` requests with `new` tokens after `cached` ones, blocks shuffled."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    per_request = -(-(cached + new) // BLOCK)
    blocks = list(range(1, 1 + batch * per_request))
    random.Random(seed).shuffle(blocks)
    tables = [blocks[i * per_request:(i + 1) * per_request] for i in range(batch)]
    tokens = batch * new

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)

    cache_shape = (1 + batch * per_request, BLOCK, KV_HEADS, HEAD_DIM)
    meta = AttentionMetadata.build(
        [new] * batch, [cached] * batch, tables, BLOCK, torch.device("cuda")
    )
    return Inputs(randn(tokens, HEADS, HEAD_DIM), randn(tokens, KV_HEADS, HEAD_DIM),
                  randn(tokens, KV_HEADS, HEAD_DIM), randn(*cache_shape), randn(*cache_shape),
                  meta)


def layer_forward(backend_name: str, inputs: Inputs, **options: int) -> Callable[[], object]:
    """One layer's attention call; the metadata (and its plans) is shared, as across layers."""
    backend: AttentionBackend
    if backend_name == "triton":
        from pytgi_shard.attention.triton_backend import TritonAttention

        backend = TritonAttention(**options)
    else:
        backend = get_backend(backend_name)
    i = inputs
    return lambda: backend.forward(
        i.q, i.k, i.v, i.key_cache, i.value_cache, i.meta, HEAD_DIM**-0.5
    )


def decode_rows(batch: int, context: int, sweep: bool) -> list[Row]:
    inputs = make_inputs(batch, 1, context - 1)
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * 2
    variants: list[tuple[str, dict[str, int]]] = [("reference", {}), ("triton", {})]
    if sweep:
        variants += [(f"triton/{s}", {"num_splits": s}) for s in (1, 2, 4, 8, 16)]
    rows = []
    for label, options in variants:
        inputs.meta.plans = AttentionPlans()
        forward = layer_forward(label.split("/")[0], inputs, **options)
        try:
            ms = time_ms(forward, graph=True)
        except RuntimeError:  # not capturable: time it as it would run, eagerly
            torch.cuda.synchronize()
            inputs.meta.plans = AttentionPlans()
            ms = time_ms(forward)
            label += "(eager)"
        rows.append(Row("decode", batch, 1, context, label, ms, kv_bytes / ms / 1e6))
    return rows


def causal_flops(batch: int, new: int, context: int) -> float:
    """QK^T and PV over the allowed (query, key) pairs: 4 * D flops per pair per head."""
    cached = context - new
    pairs = new * cached + new * (new + 1) / 2
    return 4.0 * HEAD_DIM * HEADS * batch * pairs


def prefill_rows(batch: int, new: int, cached: int) -> list[Row]:
    inputs = make_inputs(batch, new, cached)
    flops = causal_flops(batch, new, cached + new)
    rows = []
    for label in ("reference", "triton"):
        inputs.meta.plans = AttentionPlans()
        ms = time_ms(layer_forward(label, inputs))
        rows.append(Row("prefill", batch, new, cached + new, label, ms, flops / ms / 1e9))
    if cached == 0:
        q = inputs.q.view(batch, new, HEADS, HEAD_DIM).transpose(1, 2)
        k = inputs.k.view(batch, new, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = inputs.v.view(batch, new, KV_HEADS, HEAD_DIM).transpose(1, 2)
        ms = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                            enable_gqa=True))
        rows.append(Row("prefill", batch, new, new, "sdpa-dense", ms, flops / ms / 1e9))
    return rows


def prefill_config_rows(batch: int, new: int, cached: int) -> list[Row]:
    """The prefill kernel alone (no cache write) under each candidate tile configuration."""
    from pytgi_shard.attention.triton_prefill import PrefillConfig, paged_prefill

    i = make_inputs(batch, new, cached)
    flops = causal_flops(batch, new, cached + new)
    rows = []
    for block_m, block_n, warps, stages in ((64, 64, 4, 2), (64, 128, 4, 2), (128, 64, 8, 2),
                                            (128, 64, 8, 3), (128, 128, 8, 2), (64, 32, 4, 3)):
        config = PrefillConfig(block_m, block_n, warps, stages)

        def kernel(config: PrefillConfig = config) -> torch.Tensor:
            return paged_prefill(
                i.q, i.key_cache, i.value_cache, i.meta.block_tables, i.meta.seqlens_k,
                i.meta.cu_seqlens_q, i.meta.max_seqlen_q, HEAD_DIM**-0.5, config=config)

        try:
            ms = time_ms(kernel)
        except Exception as e:  # e.g. out of shared memory: report and go on
            print(f"config {config}: {type(e).__name__}: {str(e)[:120]}")
            continue
        label = f"m{block_m}n{block_n}w{warps}s{stages}"
        rows.append(Row("prefill", batch, new, cached + new, label, ms, flops / ms / 1e9))
    return rows


def print_table(rows: list[Row]) -> None:
    print(f"{'kind':8} {'batch':>5} {'new':>5} {'ctx':>5} {'backend':12} {'ms':>9} {'rate':>9}")
    for r in rows:
        unit = "GB/s" if r.kind == "decode" else "TFLOP/s"
        print(f"{r.kind:8} {r.batch:5d} {r.new_tokens:5d} {r.context:5d} {r.backend:12} "
              f"{r.ms:9.4f} {r.rate:9.1f} {unit}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", action="store_true", help="also time each decode split count")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("attention_kernels needs a CUDA GPU")
    print(torch.cuda.get_device_name(), f"torch {torch.__version__}")
    rows: list[Row] = []
    for batch in (1, 16, 64, 256):
        for context in (512, 2048):
            rows += decode_rows(batch, context, args.sweep)
    for batch, new, cached in ((1, 512, 0), (1, 2048, 0), (4, 1024, 0), (8, 512, 0),
                               (1, 512, 1536)):
        rows += prefill_rows(batch, new, cached)
        if args.sweep:
            rows += prefill_config_rows(batch, new, cached)
    print_table(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)


if __name__ == "__main__":
    main()

"""CPU decode graphs: each decode bucket's forward traced once and compiled (--cpu-graphs).

On a CPU the forward of a small model is not arithmetic but dispatch: a decode step of the demo
model runs ~500 ATen ops at 3-25 us each on a small VM (a 128-wide RMSNorm alone costs ~60 us in
eager PyTorch), so eager decode spends most of its time between kernels. The CUDA answer, a
graph replay, does not exist on a CPU; its counterpart here is a compiled step: the padded
decode forward of one batch-size bucket (decode_graphs.DecodeGraphRunner's buffers, the same
padding and the same static context) is traced to one flat ATen graph and compiled by inductor's
C++ backend, which fuses the elementwise work into a few loops and generates the matmuls from
its GEMM template over weights frozen and packed once (INDUCTOR_OPTIONS).

Why trace with make_fx rather than torch.compile the model directly: the model's Python
(attention metadata, per-forward plan caches, dataclass keys) breaks dynamo's graph into a dozen
pieces per layer, each with guards, which was measured slower than eager. make_fx runs the
forward once on the real buffers and records only the ATen ops, so nothing above them matters.
What it cannot see is a value read back to the host (`.item()`, `bool(tensor)`): that would be
frozen into the graph. So a trace that reads any tensor back is refused (the model decodes
eagerly, with one log line), and every compiled bucket is checked against the eager forward on
the buffers before it is used.

The KV cache tensors and the runner's buffers are the compiled step's inputs: its writes land in
the live cache (a cache resized by a later Warmup needs a new compile, as a CUDA graph needs a
new capture), and each call reads the values the step copied into the buffers. The weights are
held by reference.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from pytgi_shard.attention.kv_cache import KVCache

log = logging.getLogger(__name__)

# The ATen op a tensor's read-back to the host goes through (Tensor.item, bool, int, tolist).
_HOST_READ = "_local_scalar_dense"

# How far a compiled step's logits may differ from eager's: inductor reorders float reductions.
ATOL = 1e-3

# Inductor's options. freezing + max_autotune over the C++ GEMM template: the weights become
# constants, packed once into the template's blocked layout, and every matmul is a generated C++
# micro-GEMM (AVX2 and up) that streams them, split over the torch threads; at batch 1 ATen's
# BLAS call ran a 128x4096 GEMV at ~60 us against weights the previous layers had pushed out of
# cache. Measured on the demo model (compiled directly, 1 thread, load ~1): 1,134 us a batch-1
# step against 1,680 us with ATen's matmuls, 1,949 against 3,137 us at batch 4. The price: each
# compiled bucket holds its own packed copy of the matmuls' weights (logged), and such a
# graph is not kept in inductor's disk cache (packed weights do not pickle), so each start
# compiles again (~30 s a bucket on 2 cores, in the background). cpp_wrapper: the compiled
# graph's kernel calls are made from C++, not a Python wrapper (2.17 against 2.68 ms a forward
# when measured with ATen's matmuls).
INDUCTOR_OPTIONS: dict[str, str | int | bool | Callable[..., Any]] = {
    "cpp_wrapper": True,
    "freezing": True,
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP",
}

# A compiled step: the logits of the bucket's forward over the given cache.
Step = Callable[[KVCache], torch.Tensor]
# What is traced: the forward over a cache and the step's input tensors.
Run = Callable[..., torch.Tensor]
# A compiled `Run`: the forward over a cache and input tensors of the traced shapes.
Compiled = Callable[[KVCache, Sequence[torch.Tensor]], torch.Tensor]


class NotCompilable(Exception):
    """The forward cannot be a compiled step: it reads a tensor back to the host, or the
    compiled step's logits differ from the eager forward's."""


def trace(run: Run, kv_cache: KVCache, inputs: Sequence[torch.Tensor]) -> fx.GraphModule:
    """`run(kv_cache, *inputs)` as one ATen graph whose inputs are the cache's tensors (keys,
    values) then `inputs`; what else it reads (the weights) is held by reference. The step's
    own inputs must be graph inputs: a host read of a tensor the trace holds as a constant is
    not recorded, so it could not be refused."""
    from torch.fx.experimental.proxy_tensor import make_fx

    layers = len(kv_cache.keys)
    scales = kv_cache.scales

    def over(*tensors: torch.Tensor) -> torch.Tensor:
        cache = KVCache(keys=list(tensors[:layers]), values=list(tensors[layers:2 * layers]),
                        scales=scales)
        return run(cache, *tensors[2 * layers:])

    try:
        return make_fx(over)(*kv_cache.keys, *kv_cache.values, *inputs)
    except RuntimeError as e:
        # make_fx refuses a read of a traced tensor's value (.item(), bool, a data-dependent
        # shape); anything else is a bug to see.
        if _HOST_READ not in str(e):
            raise
        raise NotCompilable("the decode forward reads a tensor value back to the host "
                            "(data-dependent control flow)") from e


def compile_step(run: Run, kv_cache: KVCache, inputs: Sequence[torch.Tensor]) -> Compiled:
    """`run` traced over `inputs` and compiled: the returned function takes the cache and input
    tensors of the same shapes (each call reads their current values). Checked equal to `run`
    (eager) on `inputs` before it is returned."""
    start = time.perf_counter()
    with torch.no_grad():
        gm = trace(run, kv_cache, inputs)
    with torch.inference_mode():
        compiled = _inductor(gm, [*kv_cache.keys, *kv_cache.values, *inputs])

    def step(cache: KVCache, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        out: torch.Tensor = compiled(*cache.keys, *cache.values, *tensors)
        return out

    with torch.inference_mode():
        expected = run(kv_cache, *inputs)
        got = step(kv_cache, inputs)
    if got.shape != expected.shape or not torch.allclose(got, expected, atol=ATOL, rtol=0):
        diff = (got - expected).abs().max().item() if got.shape == expected.shape else None
        raise NotCompilable(f"the compiled decode step differs from the eager forward "
                            f"(max |diff| {diff})")
    log.info("compiled a decode step of %d ops in %.1f s; it holds a packed copy of the "
             "matmuls' weights (%.1f MB)", len(gm.graph.nodes), time.perf_counter() - start,
             matmul_weight_bytes(gm) / 2**20)
    return step


def matmul_weight_bytes(gm: fx.GraphModule) -> int:
    """The bytes of the weights `gm` multiplies by (what freezing packs a copy of): each
    matmul's second operand, followed back through its views to the tensor the graph holds."""
    held: dict[str, torch.Tensor] = {}
    for node in gm.graph.nodes:
        if node.target not in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            continue
        weight = node.args[-1]
        while isinstance(weight, fx.Node) and weight.op == "call_function" and weight.args:
            weight = weight.args[0]
        if isinstance(weight, fx.Node) and weight.op == "get_attr":
            held[str(weight.target)] = getattr(gm, str(weight.target))
    return sum(t.numel() * t.element_size() for t in held.values())


def _inductor(gm: fx.GraphModule, example: list[torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`gm` compiled by inductor directly, without dynamo: a call is the compiled graph and
    nothing else. Through torch.compile each call first ran dynamo's guards over the graph's ~60
    tensors and AOTAutograd's Python wrappers: 40% of a batch-1 step's time (2,150 against
    1,680 us). Nothing here needs a guard: the runner calls each step with the same tensors.

    make_fx leaves each node's fake value (from fake modes of its own) in the node's meta, which
    inductor would try to reuse; dropped, inductor traces the graph again under one fake mode."""
    import torch._inductor

    for node in gm.graph.nodes:
        node.meta.pop("val", None)
        node.meta.pop("tensor_meta", None)
    inputs: list[Any] = list(example)
    return torch._inductor.compile(gm, inputs, options=INDUCTOR_OPTIONS)  # type: ignore[no-any-return]

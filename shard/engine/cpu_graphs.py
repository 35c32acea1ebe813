"""CPU decode graphs: each decode bucket's forward traced once and compiled (--cpu-graphs).

On a CPU the forward of a small model is not arithmetic but dispatch: a decode step of the demo
model runs ~500 ATen ops at 3-25 us each on a small VM (a 128-wide RMSNorm alone costs ~60 us in
eager PyTorch), so eager decode spends most of its time between kernels. The CUDA answer, a
graph replay, does not exist on a CPU; its counterpart here is a compiled step: the padded
decode forward of one batch-size bucket (decode_graphs.DecodeGraphRunner's buffers and padding)
is traced to one flat ATen graph and compiled by inductor's C++ backend, which fuses the
elementwise work into a few loops and generates the matmuls from its GEMM template over weights
frozen and packed once (INDUCTOR_OPTIONS). Unlike a CUDA graph, one compiled step serves every
context width: the trace runs over fake tensors whose block-table width is a symbol (FreeSize).

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
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import (
    DimDynamic,
    GuardOnDataDependentSymNode,
    ShapeEnv,
    StatelessSymbolicContext,
)

from pytgi_shard.attention.kv_cache import KVCache

log = logging.getLogger(__name__)

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

# A compiled step: the logits of the bucket's forward over the given cache, attending the
# context of the given number of KV blocks (decode_graphs.DecodeGraphRunner.compile_bucket).
Step = Callable[[KVCache, int], torch.Tensor]
# What is traced: the forward over a cache and the step's input tensors.
Run = Callable[..., torch.Tensor]
# A compiled `Run`: the forward over a cache and input tensors of the traced shapes, and the
# size its free size is narrowed to (None: as traced).
Compiled = Callable[[KVCache, Sequence[torch.Tensor], int | None], torch.Tensor]

# The smallest size a free size takes: a trace assumes a symbolic size is neither 0 nor 1 (its
# code may differ at those), so a caller pads a narrower input up to this.
FREE_FROM = 2


@dataclass(frozen=True, slots=True)
class FreeSize:
    """One dimension of one of a step's inputs that the compiled step reads at each call rather
    than fixing at its traced size: the width of the block tables, so that a step attends the
    context its longest row has, not the static one it was traced over (a batch-64 step of the
    demo model over 48 positions: 9.5 ms, against 27.9 ms over the static 256; batch 1: 0.97
    against 1.26 ms; both with gathered SDPA, bench/results/cpu/compiled_step_context.json)."""

    input: int  # index among the step's inputs (after the cache's tensors)
    dim: int


class NotCompilable(Exception):
    """The forward cannot be a compiled step: it reads a tensor back to the host, or the
    compiled step's logits differ from the eager forward's."""


class FreeSizeGuarded(Exception):
    """The forward's code depends on the free size's value (a branch, a division), so one
    compiled step cannot serve every size: the step is compiled at its traced size instead."""


def trace(run: Run, kv_cache: KVCache, inputs: Sequence[torch.Tensor],
          free: FreeSize | None = None) -> fx.GraphModule:
    """`run(kv_cache, *inputs)` as one ATen graph whose inputs are the cache's tensors (keys,
    values) then `inputs`; what else it reads (the weights) is held by reference. Traced over
    fake tensors of the inputs' shapes, `free`'s dimension symbolic; FreeSizeGuarded when the
    code's path depends on it. The step's own inputs must be graph inputs: a host read of a
    tensor the trace holds as a constant would not be seen, so it could not be refused."""
    return _trace(run, kv_cache, inputs, free)[0]


def _trace(
    run: Run, kv_cache: KVCache, inputs: Sequence[torch.Tensor], free: FreeSize | None
) -> tuple[fx.GraphModule, FakeTensorMode, list[torch.Tensor]]:
    """trace's graph, with the fake mode and fake inputs it was traced over (the compiler's)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    layers = len(kv_cache.keys)
    scales = kv_cache.scales

    def over(*tensors: torch.Tensor) -> torch.Tensor:
        cache = KVCache(keys=list(tensors[:layers]), values=list(tensors[layers:2 * layers]),
                        scales=scales)
        return run(cache, *tensors[2 * layers:])

    mode, fakes = _fake_inputs([*kv_cache.keys, *kv_cache.values], inputs, free)
    try:
        with torch.no_grad(), mode:
            gm = make_fx(over)(*fakes)
    except GuardOnDataDependentSymNode as e:
        # A read of a traced tensor's value (.item(), bool, a data-dependent shape) would be
        # frozen into the graph.
        raise NotCompilable("the decode forward reads a tensor value back to the host "
                            "(data-dependent control flow)") from e
    if any(node.target == torch.ops.aten._local_scalar_dense.default for node in gm.graph.nodes):
        raise NotCompilable("the decode forward reads a tensor value back to the host")
    if free is not None:
        _check_unguarded(mode, inputs[free.input].shape[free.dim])
    return gm, mode, fakes


def _fake_inputs(
    cache: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], free: FreeSize | None
) -> tuple[FakeTensorMode, list[torch.Tensor]]:
    """A fake mode with a shape environment, and the graph's inputs as its fake tensors: every
    size static but `free`'s. Tensors the forward reads besides them (the weights) enter the
    trace as constants."""
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)

    def fake(tensor: torch.Tensor, dim: int | None) -> torch.Tensor:
        sizes = [DimDynamic.DYNAMIC if d == dim else DimDynamic.STATIC
                 for d in range(tensor.dim())]
        context: StatelessSymbolicContext[Any, Any] = StatelessSymbolicContext(
            dynamic_sizes=sizes)  # type: ignore[arg-type]
        return mode.from_tensor(tensor, symbolic_context=context)

    fakes = [fake(t, None) for t in cache]
    for i, tensor in enumerate(inputs):
        fakes.append(fake(tensor, free.dim if free is not None and free.input == i else None))
    return mode, fakes


def _check_unguarded(mode: FakeTensorMode, largest: int) -> None:
    """FreeSizeGuarded unless every condition the trace (or the compiler) assumed of the free
    size holds at each size a caller may pass, FREE_FROM to `largest` (its traced size). A
    guard states what the path taken needs: a bound the traced sizes meet anyway (an index
    within a table) is harmless; a branch on the size is not."""
    env = mode.shape_env
    if env is None or not env.guards:
        return
    for guard in env.guards:
        symbols = guard.expr.free_symbols
        for size in range(FREE_FROM, largest + 1):
            if not bool(guard.expr.xreplace(dict.fromkeys(symbols, size))):
                raise FreeSizeGuarded(f"its code depends on it: {guard.expr} fails at {size}")


def compile_step(run: Run, kv_cache: KVCache, inputs: Sequence[torch.Tensor],
                 free: FreeSize | None = None, eager: Run | None = None) -> Compiled:
    """`run` traced over `inputs` and compiled: the returned function takes the cache, input
    tensors of the same shapes (each call reads their current values) and the size to narrow
    `free`'s dimension to (raised to FREE_FROM; None, or a step compiled at its static size:
    all of it). Checked equal to `eager` (by default `run` itself, run eagerly) as traced, and
    narrowed to FREE_FROM, before it is returned: a forward written for the compiler is checked
    against the plain one, which eagerly is also the one that fits in memory. A forward whose
    code depends on the free size is compiled at `inputs`' sizes (logged)."""
    start = time.perf_counter()
    try:
        gm, compiled = _traced_and_compiled(run, kv_cache, inputs, free)
    except FreeSizeGuarded as e:
        log.info("the decode step is compiled for its static context: %s", e)
        gm, compiled = _traced_and_compiled(run, kv_cache, inputs, None)
        free = None

    def step(cache: KVCache, tensors: Sequence[torch.Tensor], size: int | None) -> torch.Tensor:
        out: torch.Tensor = compiled(*cache.keys, *cache.values, *_narrowed(tensors, free, size))
        return out

    reference = run if eager is None else eager
    _check(reference, step, kv_cache, inputs, free, None)
    if free is not None and inputs[free.input].shape[free.dim] > FREE_FROM:
        _check(reference, step, kv_cache, inputs, free, FREE_FROM)
    log.info("compiled a decode step of %d ops in %.1f s; it holds a packed copy of the "
             "matmuls' weights (%.1f MB)", len(gm.graph.nodes), time.perf_counter() - start,
             matmul_weight_bytes(gm) / 2**20)
    return step


def _narrowed(
    tensors: Sequence[torch.Tensor], free: FreeSize | None, size: int | None
) -> Sequence[torch.Tensor]:
    """`tensors` with the free size narrowed to `size` (at least FREE_FROM, at most all), as a
    contiguous copy: the trace saw a contiguous tensor, whose strides follow its free size."""
    if free is None or size is None:
        return tensors
    tensor = tensors[free.input]
    full = tensor.shape[free.dim]
    narrowed = list(tensors)
    narrowed[free.input] = tensor.narrow(free.dim, 0, min(max(size, FREE_FROM), full)).contiguous()
    return narrowed


def _traced_and_compiled(
    run: Run, kv_cache: KVCache, inputs: Sequence[torch.Tensor], free: FreeSize | None
) -> tuple[fx.GraphModule, Callable[..., torch.Tensor]]:
    gm, mode, fakes = _trace(run, kv_cache, inputs, free)
    with torch.inference_mode():
        compiled = _inductor(gm, fakes)
    if free is not None:
        _check_unguarded(mode, inputs[free.input].shape[free.dim])
    return gm, compiled


def _check(run: Run, step: Compiled, kv_cache: KVCache, inputs: Sequence[torch.Tensor],
           free: FreeSize | None, size: int | None) -> None:
    """NotCompilable unless the compiled step's logits are the eager forward's on `inputs`
    with the free size narrowed to `size`."""
    with torch.inference_mode():
        expected = run(kv_cache, *_narrowed(inputs, free, size))
        got = step(kv_cache, inputs, size)
    if got.shape != expected.shape or not torch.allclose(got, expected, atol=ATOL, rtol=0):
        diff = (got - expected).abs().max().item() if got.shape == expected.shape else None
        raise NotCompilable(f"the compiled decode step differs from the eager forward "
                            f"(max |diff| {diff})")


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
    1,680 us). Nothing here needs a guard: the runner calls each step with the same tensors,
    the free size aside, of which the trace and the compiler assumed nothing that a size it is
    called with fails (_check_unguarded).

    `example`: the fake inputs the graph was traced over (its free size symbolic). make_fx
    leaves each node's fake value in the node's meta; dropped, inductor propagates them again
    from `example`, under its fake mode."""
    import torch._inductor

    for node in gm.graph.nodes:
        node.meta.pop("val", None)
        node.meta.pop("tensor_meta", None)
    inputs: list[Any] = list(example)
    return torch._inductor.compile(gm, inputs, options=INDUCTOR_OPTIONS)  # type: ignore[no-any-return]

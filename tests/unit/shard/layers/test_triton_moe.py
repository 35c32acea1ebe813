"""The Triton grouped GEMM of the MoE experts (shard/layers/triton_grouped_gemm.py) against the
grouped PyTorch path, and a whole MoE model through it against transformers.

On CPU the kernels run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 when
no GPU is present), on a GPU compiled, where the path is also captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from pytgi_shard.device.distributed import single_process  # noqa: E402
from pytgi_shard.layers.grouped_experts import grouped_experts  # noqa: E402
from pytgi_shard.layers.moe import SparseMoE  # noqa: E402
from pytgi_shard.layers.moe_routing import route  # noqa: E402
from pytgi_shard.layers.triton_grouped_gemm import tile_rows, triton_experts  # noqa: E402
from pytgi_shard.models import ModelConfig, get_model  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter computes through numpy, which has no bfloat16.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def eager_activation(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def _case(
    tokens: int, top_k: int, num: int, hidden: int, inter: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(tokens * num + hidden)
    x = torch.randn(tokens, hidden, generator=g)
    gate_up = torch.randn(num, 2 * inter, hidden, generator=g) * 0.2
    down = torch.randn(num, hidden, inter, generator=g) * 0.2
    routing = route(torch.randn(tokens, num, generator=g), top_k, True, dtype)
    return tuple(t.to(DEVICE) for t in (
        x.to(dtype), routing.experts, routing.weights, gate_up.to(dtype), down.to(dtype)
    ))  # fmt: skip


# Decode-sized (16-row tiles) and prefill-sized (64-row tiles) groups; hidden and inter sizes
# that are not multiples of the kernel's K tile.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("tokens", "top_k", "num", "hidden", "inter"), [(1, 2, 8, 64, 32), (3, 3, 5, 48, 40), (40, 2, 4, 40, 72)]
)
def test_grouped_gemm_equals_grouped_path(
    dtype: torch.dtype, tokens: int, top_k: int, num: int, hidden: int, inter: int
) -> None:
    x, experts, weights, gate_up, down = _case(tokens, top_k, num, hidden, inter, dtype)
    expected = grouped_experts(x, experts, weights, gate_up, down, F.silu)
    got = triton_experts(x, experts, weights, gate_up, down, eager_activation)
    torch.testing.assert_close(got, expected, rtol=TOL[dtype], atol=TOL[dtype])


def test_tile_rows_follow_group_sizes() -> None:
    assert tile_rows(2, 8) == 16 and tile_rows(64 * 8, 8) == 64


def test_grouped_gemm_skips_other_ranks_experts() -> None:
    """Expert parallel: assignments to experts held elsewhere (id = held count) add nothing."""
    x, experts, weights, gate_up, down = _case(6, 2, 6, 32, 16, torch.float32)
    local = torch.where(experts < 3, experts, 3)
    expected = grouped_experts(x, local, weights, gate_up[:3], down[:3], F.silu)
    got = triton_experts(x, local, weights, gate_up[:3], down[:3], eager_activation)
    torch.testing.assert_close(got, expected)
    assert got.abs().sum() > 0


@pytest.mark.skipif(DEVICE == "cuda", reason="a CPU model with its blocks switched to the "
                    "interpreted kernels; on a GPU the kernel tests above run compiled")
def test_moe_model_through_the_grouped_gemm_matches_transformers(
    tiny_model: Callable[..., Path],
) -> None:
    """Qwen2-MoE (shared expert, a dense layer, unnormalised top-k) with its blocks switched to
    the Triton path and the fused activation kernel: every step's logits equal transformers'."""
    from tests.unit.shard.models.test_models import (
        assert_matches,
        hf_logits,
        paged_logits,
        sequences,
    )

    path = tiny_model("qwen2_moe")
    model = get_model(ModelConfig.read(path), dtype=torch.float32, dist=single_process(torch.device("cpu")))
    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]  # type: ignore[attr-defined]
    for block in blocks:
        block.triton, block.kernel_act = True, "silu"
    assert blocks and all(block.capturable for block in blocks)
    seqs = sequences(model.vocab_size)
    assert_matches(paged_logits(model, seqs), hf_logits(path, seqs))


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_grouped_gemm_is_captured_in_a_cuda_graph() -> None:
    """The decode path: layout, both GEMMs and the sum captured once, replayed on new routing."""
    x, experts, weights, gate_up, down = _case(8, 2, 8, 128, 64, torch.float16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm the kernels up before capture
        triton_experts(x, experts, weights, gate_up, down, eager_activation)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_experts(x, experts, weights, gate_up, down, eager_activation)
    # New inputs in the captured buffers: other tokens, other experts, other weights.
    x.mul_(-0.5)
    experts.copy_(experts.flip(0))
    weights.copy_(weights.flip(0))
    graph.replay()
    expected = grouped_experts(x, experts, weights, gate_up, down, F.silu)
    torch.testing.assert_close(out, expected, rtol=2e-3, atol=2e-3)

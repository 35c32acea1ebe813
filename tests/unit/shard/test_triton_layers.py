"""The fused layer kernels (add + RMSNorm, gated activation) against the eager layers they replace.

On CPU they run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 when no
GPU is present); on a GPU the same tests run the compiled kernels.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pytgi_shard.layers.layernorm import RMSNorm  # noqa: E402
from pytgi_shard.layers.mlp import ACTIVATIONS  # noqa: E402
from pytgi_shard.layers.triton_activation import gated_activation  # noqa: E402
from pytgi_shard.layers.triton_norm import add_rms_norm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter computes through numpy, which has no bfloat16.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "hidden"), [(1, 64), (7, 96), (3, 130)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_eager(
    dtype: torch.dtype, tokens: int, hidden: int, with_residual: bool
) -> None:
    g = torch.Generator().manual_seed(tokens * hidden)
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE, dtype)
    residual = torch.randn(tokens, hidden, generator=g).to(DEVICE, dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(DEVICE, dtype)
    norm = RMSNorm(weight, 1e-5)
    expected_sum = x + residual if residual is not None else x
    expected = norm(expected_sum)

    out, total = add_rms_norm(x, residual, weight, 1e-5)

    assert torch.equal(total, expected_sum)
    # Same roundings; only the reduction order may differ (one ulp of the model dtype).
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)


def test_add_rms_norm_leaves_inputs_alone() -> None:
    x, residual = torch.randn(4, 32).to(DEVICE), torch.randn(4, 32).to(DEVICE)
    x0, r0 = x.clone(), residual.clone()
    add_rms_norm(x, residual, torch.ones(32, device=DEVICE), 1e-6)
    assert torch.equal(x, x0) and torch.equal(residual, r0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize(("tokens", "inter"), [(1, 64), (5, 100), (2, 1500)])
def test_gated_activation_matches_eager(dtype: torch.dtype, act: str, tokens: int, inter: int) -> None:
    g = torch.Generator().manual_seed(tokens + inter)
    gate_up = (3 * torch.randn(tokens, 2 * inter, generator=g)).to(DEVICE, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = ACTIVATIONS[act](gate) * up

    out = gated_activation(gate_up, act)

    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)


def test_kernels_refuse_layouts_they_cannot_read() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        add_rms_norm(torch.randn(8, 4).t(), None, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="2 \\* inter"):
        gated_activation(torch.randn(3, 5), "silu")

"""The fused layer kernels (add + RMSNorm, gated activation, rotary) against the eager layers they replace.

On CPU they run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 when no
GPU is present); on a GPU the same tests run the compiled kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from pytgi_shard.device.distributed import single_process  # noqa: E402
from pytgi_shard.layers.layernorm import RMSNorm  # noqa: E402
from pytgi_shard.layers.mlp import ACTIVATIONS, GatedMLP  # noqa: E402
from pytgi_shard.layers.rotary import (  # noqa: E402
    RotaryEmbedding,
    apply_rotary,
    rotation_tables,
)
from pytgi_shard.layers.triton_activation import (  # noqa: E402
    KERNEL_ACTIVATIONS,
    gated_activation,
)
from pytgi_shard.layers.triton_norm import add_rms_norm  # noqa: E402
from pytgi_shard.layers.triton_rotary import rotate_qk  # noqa: E402
from pytgi_shard.models import ModelConfig, get_model  # noqa: E402

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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "dim"), [(1, 4, 4, 16), (5, 6, 2, 32)])
def test_rotate_qk_matches_eager_on_strided_views(
    dtype: torch.dtype, tokens: int, heads: int, kv_heads: int, dim: int
) -> None:
    g = torch.Generator().manual_seed(tokens * heads)
    q_size, kv_size = heads * dim, kv_heads * dim
    # The views the attention layer takes of the fused qkv projection's output.
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=g).to(DEVICE, dtype)
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)
    rotary = RotaryEmbedding(dim, 10000.0, 2048, None, torch.device(DEVICE))
    positions = torch.randint(0, 2000, (tokens,), generator=g).to(DEVICE)
    cos, sin = rotary.cos_sin(positions)
    tables = rotation_tables(cos, sin, dtype)

    q_out, k_out = rotate_qk(q, k, cos, sin)

    assert q_out.is_contiguous() and k_out.is_contiguous()
    # The same roundings in the same order: bit-identical under the interpreter. Compiled, the
    # H100 run differed from eager CUDA by one ulp on some half-precision elements.
    if DEVICE == "cuda":
        tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
        torch.testing.assert_close(q_out, apply_rotary(q, *tables), rtol=tol, atol=tol)
        torch.testing.assert_close(k_out, apply_rotary(k, *tables), rtol=tol, atol=tol)
    else:
        assert torch.equal(q_out, apply_rotary(q, *tables))
        assert torch.equal(k_out, apply_rotary(k, *tables))


def _fuse_everything(model: torch.nn.Module) -> None:
    """Switches every layer of a CPU-loaded model to its Triton kernel (the interpreter runs them)."""
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.fused = True
        elif isinstance(module, GatedMLP):
            module.kernel_act = KERNEL_ACTIVATIONS.get("silu")
        elif hasattr(module, "fused_rotary"):
            module.fused_rotary = True


@pytest.mark.skipif(DEVICE == "cuda", reason="CPU model under the interpreter; on a GPU the "
                    "fused kernels run in every model test (tests/gpu)")
def test_llama_with_fused_kernels_matches_transformers(tiny_model: Callable[..., Path]) -> None:
    """The residual hand-off between layers, the final norm over selected rows and the fused
    rotary wired into a whole model: the logits of every step equal transformers'."""
    from tests.unit.shard.models.test_models import (
        assert_matches,
        hf_logits,
        paged_logits,
        sequences,
    )

    path = tiny_model("llama")
    model = get_model(ModelConfig.read(path), dtype=torch.float32, dist=single_process(torch.device("cpu")))
    _fuse_everything(model)  # type: ignore[arg-type]
    seqs = sequences(model.vocab_size)
    assert_matches(paged_logits(model, seqs), hf_logits(path, seqs))

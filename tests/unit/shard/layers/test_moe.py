"""The sparse MoE block (shard/layers/moe.py) and its parts against transformers' blocks and a
naive per-token loop: routing normalisations, the grouped PyTorch path, the padded per-expert
layout, the Triton grouped GEMM (under the interpreter on CPU), both shardings, config readers.

Whole models against transformers on 1 and 2 ranks: test_model_families.py; served over gRPC and
through the launcher: tests/integration/test_model_families_serving.py,
tests/e2e/test_model_families_launcher.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from pytgi_shard.device.distributed import Dist, single_process
from pytgi_shard.layers.expert_blocks import expert_blocks, padded_rows
from pytgi_shard.layers.expert_partition import ExpertNames, ExpertPartition, Sharding
from pytgi_shard.layers.grouped_experts import grouped_experts
from pytgi_shard.layers.moe import MoESpec, SparseMoE
from pytgi_shard.layers.moe_routing import route
from pytgi_shard.models import ModelConfig, get_model
from pytgi_shard.models.llama.config import LlamaConfig
from pytgi_shard.models.llama.moe import mixtral_config, qwen2_moe_config, qwen3_moe_config
from pytgi_shard.weights.reader import Weights
from tests.hf_config import hf_fields

CPU = torch.device("cpu")
Act = Callable[[torch.Tensor], torch.Tensor]


def per_token_experts(
    x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
    gate_up: torch.Tensor, down: torch.Tensor, act: Act,
) -> torch.Tensor:  # fmt: skip
    """The naive loop: each token through each of its experts, one at a time."""
    held = gate_up.shape[0]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(experts[t].tolist(), weights[t], strict=True):
            if e < held:
                gate, up = F.linear(x[t], gate_up[e]).chunk(2, dim=-1)
                out[t] += F.linear(act(gate) * up, down[e]) * w
    return out


def test_routing_normalisations() -> None:
    """Mixtral (and norm_topk_prob): the top-k softmax weights renormalised to sum 1; Qwen
    without norm_topk_prob: the softmax probabilities of the chosen experts as they are."""
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0], [0.0, 0.0, 3.0, 0.5]])
    probs = torch.softmax(logits, -1)
    raw = route(logits, 2, renormalize=False, dtype=torch.float32)
    assert raw.experts.tolist() == [[0, 2], [2, 3]]
    torch.testing.assert_close(raw.weights, probs.gather(1, raw.experts))
    assert (raw.weights.sum(-1) < 1).all()
    normed = route(logits, 2, renormalize=True, dtype=torch.float32)
    assert torch.equal(normed.experts, raw.experts)
    torch.testing.assert_close(normed.weights, raw.weights / raw.weights.sum(-1, keepdim=True))
    # bfloat16 logits are softmaxed in float32, the weights rounded to the model dtype after.
    half = route(logits.bfloat16(), 2, renormalize=True, dtype=torch.bfloat16)
    assert half.weights.dtype == torch.bfloat16
    torch.testing.assert_close(half.weights.float(), normed.weights, atol=4e-3, rtol=0)


def _experts(num: int, hidden: int, inter: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(num, 2 * inter, hidden, generator=g) * 0.2,
        torch.randn(num, hidden, inter, generator=g) * 0.2,
    )


def _skewed_routing(tokens: int, top_k: int, num: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Routing where expert 0 takes most tokens and the last expert none."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, num, generator=g)
    logits[:, 0] += 2.0
    logits[:, -1] -= 100.0
    routing = route(logits, top_k, renormalize=True, dtype=torch.float32)
    return routing.experts, routing.weights


@pytest.mark.parametrize(("tokens", "top_k", "num"), [(1, 2, 4), (9, 2, 6), (23, 3, 8)])
def test_grouped_path_equals_per_token_loop(tokens: int, top_k: int, num: int) -> None:
    x = torch.randn(tokens, 24, generator=torch.Generator().manual_seed(tokens))
    gate_up, down = _experts(num, 24, 16, seed=num)
    experts, weights = _skewed_routing(tokens, top_k, num, seed=top_k)
    expected = per_token_experts(x, experts, weights, gate_up, down, F.silu)
    torch.testing.assert_close(
        grouped_experts(x, experts, weights, gate_up, down, F.silu), expected
    )
    # Expert parallel: the experts past the first two are another rank's (id 2 = absent).
    local = torch.where(experts < 2, experts, 2)
    torch.testing.assert_close(
        grouped_experts(x, local, weights, gate_up[:2], down[:2], F.silu),
        per_token_experts(x, local, weights, gate_up[:2], down[:2], F.silu),
    )


@pytest.mark.parametrize(("tokens", "top_k", "num", "block_m"), [(1, 2, 8, 16), (40, 3, 5, 16), (70, 2, 4, 64)])
def test_expert_blocks_layout(tokens: int, top_k: int, num: int, block_m: int) -> None:
    """Every held assignment once, in expert order; each tile within one expert; padding only at
    each group's end; other ranks' assignments (id num - 1 here: absent) nowhere."""
    experts, _ = _skewed_routing(tokens, top_k, num, seed=tokens)
    held = num - 1
    local = torch.where(experts < held, experts, held)
    blocks = expert_blocks(local, held, block_m)
    count = local.numel()
    rows = blocks.sorted_ids.tolist()
    assert len(rows) == padded_rows(count, held, block_m) and len(rows) % block_m == 0
    flat = local.reshape(-1).tolist()
    wanted = sorted((e, a) for a, e in enumerate(flat) if e < held)
    assert [(flat[a], a) for a in rows if a < count] == wanted
    tiles = blocks.block_experts.tolist()
    for tile, expert in enumerate(tiles):
        ids = rows[tile * block_m : (tile + 1) * block_m]
        real = [a for a in ids if a < count]
        if expert == held:
            assert not real
            continue
        assert real and all(flat[a] == expert for a in real)
        # Padding follows the group's assignments, never precedes them.
        assert ids[: len(real)] == real


def test_sparse_moe_blocks_equal_transformers(tmp_path: Path) -> None:
    """Mixtral's, Qwen2-MoE's (shared expert; norm_topk_prob off and on) and Qwen3-MoE's blocks,
    loaded from their checkpoint names, on one rank and summed over two ranks of each sharding."""
    for name, (block, spec) in _transformers_blocks().items():
        path = tmp_path / name
        path.mkdir()
        state = {f"layer.{k}": v.contiguous() for k, v in _checkpoint_state(block, spec).items()}
        save_file(state, str(path / "model.safetensors"))
        x = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(3))
        out = block(x)  # transformers 4: (hidden, router logits); 5: hidden
        expected = (out[0] if isinstance(out, tuple) else out).reshape(14, 64)
        whole = _load_block(path, spec, single_process(CPU), "tp")
        torch.testing.assert_close(whole(x.reshape(14, 64)), expected, msg=name)
        for sharding in ("tp", "ep"):
            partials = [
                _load_block(path, spec, Dist(rank, 2, CPU, None), sharding)(x.reshape(14, 64))
                for rank in range(2)
            ]
            torch.testing.assert_close(sum(partials), expected, msg=f"{name} {sharding}")


def _checkpoint_state(block: torch.nn.Module, spec: MoESpec) -> dict[str, torch.Tensor]:
    """The block's weights under checkpoint names. transformers 5 holds the experts fused
    (experts.gate_up_proj [E, 2I, H], gate rows first; experts.down_proj [E, H, I]) and splits
    them per expert only when it saves a whole model; here that is done by hand."""
    state = dict(block.state_dict())
    fused = state.pop("experts.gate_up_proj", None)
    if fused is None:
        return state
    down = state.pop("experts.down_proj")
    gate, up = fused.chunk(2, dim=1)
    for e in range(fused.shape[0]):
        state[f"experts.{e}.{spec.names.gate}.weight"] = gate[e]
        state[f"experts.{e}.{spec.names.up}.weight"] = up[e]
        state[f"experts.{e}.{spec.names.down}.weight"] = down[e]
    return state


def _load_block(path: Path, spec: MoESpec, dist: Dist, sharding: Sharding) -> SparseMoE:
    """Rank `dist.rank`'s block; its forward returns the rank's partial sum (no all-reduce)."""
    block = SparseMoE.load(Weights(path, torch.float32, dist), "layer", spec, "silu", sharding)
    block.dist = single_process(CPU)
    return block


def _transformers_blocks() -> dict[str, tuple[torch.nn.Module, MoESpec]]:
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(0)
    qwen = ExpertNames("gate_proj", "up_proj", "down_proj")
    small = {"hidden_size": 64, "num_experts": 6, "num_experts_per_tok": 2,
             "moe_intermediate_size": 32}  # fmt: skip
    blocks: dict[str, tuple[torch.nn.Module, MoESpec]] = {
        "mixtral": (
            MixtralSparseMoeBlock(MixtralConfig(
                hidden_size=64, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2
            )),
            MoESpec(4, 2, 48, True, (True,), "block_sparse_moe", ExpertNames("w1", "w3", "w2")),
        ),
        "qwen3_moe": (
            Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(**small, norm_topk_prob=True)),
            MoESpec(6, 2, 32, True, (True,), "mlp", qwen),
        ),
    }
    for norm in (False, True):
        hf = Qwen2MoeConfig(**small, shared_expert_intermediate_size=40, norm_topk_prob=norm)
        spec = MoESpec(6, 2, 32, norm, (True,), "mlp", qwen, shared_intermediate_size=40)
        blocks[f"qwen2_moe_norm_{norm}"] = (Qwen2MoeSparseMoeBlock(hf).eval(), spec)
    with torch.no_grad():
        for block, _ in blocks.values():
            for p in block.parameters():
                p.normal_(0.0, 0.3)
    return {name: (block.eval(), spec) for name, (block, spec) in blocks.items()}


READERS = {"mixtral": mixtral_config, "qwen2_moe": qwen2_moe_config, "qwen3_moe": qwen3_moe_config}


@pytest.mark.parametrize("model_type", list(READERS))
def test_config_defaults_match_transformers(model_type: str) -> None:
    from transformers import AutoConfig

    hf = AutoConfig.for_model(model_type)
    fields = hf_fields(hf)
    ours = READERS[model_type]({"model_type": model_type})
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                 "rope_theta", "tie_word_embeddings", "rms_norm_eps"):  # fmt: skip
        assert getattr(ours, name) == fields[name], name
    assert ours.moe is not None and ours.moe.top_k == hf.num_experts_per_tok
    assert ours.moe.num_experts == (getattr(hf, "num_experts", None) or hf.num_local_experts)
    assert ours.moe.renormalize == getattr(hf, "norm_topk_prob", True)
    inter = getattr(hf, "moe_intermediate_size", hf.intermediate_size)
    assert ours.moe.intermediate_size == inter
    assert ours.moe.shared_intermediate_size == getattr(hf, "shared_expert_intermediate_size", 0)
    assert ours.layer_windows == (None,) * hf.num_hidden_layers


@pytest.mark.parametrize("model_type", ["qwen2_moe", "qwen3_moe"])
def test_sparse_layers_follow_transformers(model_type: str) -> None:
    """decoder_sparse_step and mlp_only_layers pick the same layers as transformers' decoder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    keys = {"hidden_size": 32, "intermediate_size": 16, "moe_intermediate_size": 8,
            "num_hidden_layers": 6, "num_attention_heads": 2, "num_key_value_heads": 1,
            "num_experts": 2, "num_experts_per_tok": 1, "decoder_sparse_step": 2,
            "mlp_only_layers": [3], "vocab_size": 16}  # fmt: skip
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **keys))
    expected = tuple(hasattr(layer.mlp, "experts") for layer in hf.model.layers)
    assert expected == (False, True, False, False, False, True)
    ours: LlamaConfig = READERS[model_type]({"model_type": model_type, **keys})
    assert ours.moe is not None and ours.moe.sparse_layers == expected


def test_released_checkpoint_keys_are_read(tmp_path: Path) -> None:
    """Keys a released checkpoint sets: a window on every layer, norm_topk_prob true."""
    raw = {"model_type": "qwen3_moe", "use_sliding_window": True, "sliding_window": 9,
           "norm_topk_prob": True, "num_hidden_layers": 3}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours = qwen3_moe_config(ModelConfig.read(tmp_path).raw)
    assert ours.layer_windows == (9, 9, 9) and ours.moe is not None and ours.moe.renormalize
    assert ours.qk_norm == "rms"


def test_expert_parallel_needs_experts_that_split() -> None:
    with pytest.raises(ValueError, match="6 experts do not split evenly over 4 shards"):
        ExpertPartition.of("ep", 6, Dist(0, 4, CPU, None))
    assert ExpertPartition.of("tp", 6, Dist(3, 4, CPU, None)).count == 6


def test_grouped_path_is_not_capturable_and_says_so(tiny_model: Callable[..., Path]) -> None:
    """On the CPU the blocks take the grouped PyTorch path, which reads group sizes on the host."""
    model = get_model(
        ModelConfig.read(tiny_model("qwen2_moe")), dtype=torch.float32, dist=single_process(CPU)
    )
    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]  # type: ignore[attr-defined]
    assert len(blocks) == 2 and not any(b.triton for b in blocks)  # layer 1 is dense
    assert not model.graph_capturable

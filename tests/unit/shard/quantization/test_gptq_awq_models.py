"""Whole tiny Llama checkpoints exported as GPTQ (v1 act-order asymmetric, v2 symmetric) and AWQ
GEMM, each beside the float copy of exactly what it dequantizes to; transformers runs the copy.

- Exact: the model built over the loaders with the dequantizing kernel (float32) gives
  transformers' logits through the paged cache (1e-4, as every model family), on 1 and 2 ranks.
- Served: get_model picks the kernels itself (int4pack, computing in bfloat16; act-order row
  shards padded); the logits stay within bfloat16's reach of transformers' on 1 and 2 ranks,
  and the engine's greedy tokens equal transformers' generate on the float copy.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from pytgi_shard.attention import get_backend
from pytgi_shard.device.distributed import Dist, init_distributed, single_process
from pytgi_shard.models import ModelConfig, get_model
from pytgi_shard.models.llama.config import LlamaConfig
from pytgi_shard.models.llama.model import Llama
from pytgi_shard.quantization.awq import AWQLoader
from pytgi_shard.quantization.gptq import GPTQLoader
from pytgi_shard.quantization.int4pack_weight import Int4PackWeight
from pytgi_shard.quantization.int_kernel_choice import IntKernel
from pytgi_shard.quantization.linear_format import pre_quantized_format
from pytgi_shard.quantization.packed_int_weight import PackedIntWeight
from pytgi_shard.weights.reader import Weights
from tests.hf_reference import hf_greedy
from tests.int_quantized_checkpoints import write_quantized_llama
from tests.unit.shard.models.test_models import (
    _free_port,
    assert_matches,
    hf_logits,
    paged_logits,
    positions_seen,
    sequences,
)
from tests.unit.shard.router_steps import build_engine, prompt_of, reference_run, request

CPU = torch.device("cpu")
GROUP = 32
# (method, checkpoint format, act-order, symmetric)
CASES = [("gptq", "gptq", True, False), ("gptq", "gptq_v2", False, True),
         ("awq", "gemm", False, False)]  # fmt: skip
Checkpoints = dict[str, tuple[Path, Path]]


@pytest.fixture(scope="module")
def checkpoints(
    tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Checkpoints:
    """name -> (quantized checkpoint, its dequantized float copy)."""
    root = tmp_path_factory.mktemp("quantized-llama")
    made = {}
    for method, fmt, act_order, sym in CASES:
        name = f"{fmt}-{'act-order' if act_order else 'ordered'}"
        quantized, dequantized = root / name, root / f"{name}-float"
        write_quantized_llama(tiny_model("llama"), quantized, dequantized, method, fmt,
                              act_order, sym, GROUP)  # fmt: skip
        made[name] = (quantized, dequantized)
    return made


def exact_llama(path: Path, dist: Dist) -> Llama:
    """The Llama over the checkpoint's own loader, forced onto the exact dequantizing kernel."""
    config = ModelConfig.read(path)
    q = dict(config.raw["quantization_config"])
    if q["quant_method"] == "awq":
        loader: GPTQLoader | AWQLoader = AWQLoader(4, GROUP, kernel=IntKernel.DEQUANT)
    else:
        loader = GPTQLoader(4, GROUP, q["desc_act"], q["sym"], q["checkpoint_format"],
                            kernel=IntKernel.DEQUANT)  # fmt: skip
    weights = Weights(path, torch.float32, dist, pre_quantized_format(q["quant_method"], loader))
    try:
        return Llama(LlamaConfig.from_dict(config.raw), weights, get_backend("reference"))
    finally:
        weights.close()


def _rank_main(rank: int, port: int, paths: list[Path], out_dir: Path) -> None:
    torch.set_num_threads(1)  # two ranks on a small CI machine: no oversubscription
    dist = init_distributed(rank, 2, "127.0.0.1", port, CPU)
    try:
        results = {}
        for path in paths:
            seqs = sequences(384)
            results[f"exact-{path.name}"] = paged_logits(exact_llama(path, dist), seqs)
            served = get_model(ModelConfig.read(path), dtype=torch.float32, dist=dist)
            results[f"served-{path.name}"] = paged_logits(served, seqs)
        torch.save(results, out_dir / f"rank{rank}.pt")
    finally:
        dist.close()


def assert_near(ours: list[torch.Tensor], reference: list[torch.Tensor]) -> None:
    """Within bfloat16's reach: the activations entering int4pack are rounded to 8 bits of
    mantissa, which moves these logits (about 2.5 at most) by up to 0.02; 4-bit quantization
    itself moves them by 0.5 to 1.2 (what the float copy already carries)."""
    for i, (got, full) in enumerate(zip(ours, reference, strict=True)):
        torch.testing.assert_close(got, full[positions_seen()[i]], atol=0.05, rtol=0, msg=f"{i}")


def test_exact_and_served_logits_on_one_and_two_ranks(
    checkpoints: Checkpoints, tmp_path: Path
) -> None:
    paths = [quantized for quantized, _ in checkpoints.values()]
    mp.spawn(_rank_main, args=(_free_port(), paths, tmp_path), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for quantized, dequantized in checkpoints.values():
        seqs = sequences(384)
        reference = hf_logits(dequantized, seqs)
        assert_matches(paged_logits(exact_llama(quantized, single_process(CPU)), seqs), reference)
        served = get_model(ModelConfig.read(quantized), dtype=torch.float32,
                           dist=single_process(CPU))  # fmt: skip
        kernels = {
            type(m) for m in served.modules() if isinstance(m, PackedIntWeight | Int4PackWeight)
        }
        assert kernels == {Int4PackWeight}  # every layer fits it on one rank
        assert_near(paged_logits(served, seqs), reference)
        for results in ranks:
            assert_matches(results[f"exact-{quantized.name}"], reference)
            assert_near(results[f"served-{quantized.name}"], reference)


def test_served_greedy_tokens_equal_transformers_on_the_float_copy(
    checkpoints: Checkpoints,
) -> None:
    prompts = [prompt_of(length, salt) for salt, length in enumerate([5, 9, 14])]
    for quantized, dequantized in checkpoints.values():
        run = reference_run(build_engine(quantized),
                            [request(i + 1, p, 10, []) for i, p in enumerate(prompts)])  # fmt: skip
        for i, prompt in enumerate(prompts):
            assert run.tokens[i + 1] == hf_greedy(dequantized, prompt, 10)[0], quantized.name

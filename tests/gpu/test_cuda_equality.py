"""pytgi's greedy tokens equal transformers' on a CUDA GPU, in float32 (skipped without one).

The CPU suite proves the engine against transformers on the CPU and the Triton kernels under
Triton's interpreter; this runs the compiled kernels (and the decode CUDA graphs warmup captures)
on a real GPU, through the real start-up path: a tiny random Llama, prompts of different lengths
prefilled together and decoded together past KV-block boundaries, each request's tokens equal to
transformers' `generate` on that prompt alone on the same GPU, and its logprobs close. Every
attention backend pytgi has is checked; one rank in-process, and two ranks (real shard processes
over NCCL) when two GPUs are visible. bench/gpu.sh runs it on the GPU machine.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer

from pytgi_proto import generate_pb2 as pb
from pytgi_shard.attention import BACKENDS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BLOCK = 16
MAX_NEW = 24
# 5 to 30 tokens: prompts that end inside, and decodes that cross, 16-token KV blocks.
PROMPTS = [
    "The quick brown fox",
    "Hello world! How are you today? I am fine, thank you. To be, or not to be, that is",
    "def main():\n    print('hello')\n    return 0\n",
]
ATTENTIONS = [a for a in BACKENDS if a != "triton" or importlib.util.find_spec("triton")]

Greedy = tuple[list[int], list[float]]


def encode(model: Path, texts: list[str]) -> list[list[int]]:
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    return [tok.encode(t).ids for t in texts]


def transformers_greedy(
    model_path: Path, prompts: list[list[int]], max_new: int, device: str = "cuda"
) -> list[Greedy]:
    """transformers on `device`, float32, each prompt alone: tokens and their logprobs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).eval()
    out: list[Greedy] = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            gen = model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                output_logits=True, return_dict_in_generate=True,
                pad_token_id=model.generation_config.pad_token_id,
            )  # fmt: skip
            tokens = gen.sequences[0, len(ids) :].tolist()
            logprobs = [
                torch.log_softmax(s[0].float(), -1)[t].item()
                for s, t in zip(gen.logits, tokens, strict=False)
            ]
            out.append((tokens, logprobs))
    del model
    torch.cuda.empty_cache()
    return out


def make_requests(prompts: list[list[int]], max_new: int) -> list[pb.Request]:
    requests, first = [], 1
    for rid, ids in enumerate(prompts):
        blocks = -(-(len(ids) + max_new) // BLOCK)
        requests.append(pb.Request(
            id=rid, input_ids=ids,
            stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=max_new),
            blocks=list(range(first, first + blocks)),
        ))  # fmt: skip
        first += blocks
    return requests


def collect(call: Callable[[str, Any], Any], requests: list[pb.Request]) -> dict[int, Greedy]:
    """Prefill the requests as one batch and decode until every one finished."""
    out: dict[int, Greedy] = {r.id: ([], []) for r in requests}
    batch = pb.Batch(id=1, requests=requests, size=len(requests))
    response = call("Prefill", pb.PrefillRequest(batch=batch))
    while True:
        for g in response.generations:
            out[g.request_id][0].extend(g.tokens.ids)
            out[g.request_id][1].extend(g.tokens.logprobs)
        if not response.HasField("batch"):
            return out
        response = call("Decode", pb.DecodeRequest(batches=[response.batch]))


def assert_same(
    got: dict[int, Greedy], expected: list[Greedy], on_cpu: list[Greedy] | None = None
) -> None:
    """Tokens equal and logprobs close; on a mismatch the message also says how far each side
    is from transformers on the CPU, to tell a CUDA-only difference from a model difference."""
    for rid, (tokens, logprobs) in enumerate(expected):
        where = ""
        if on_cpu is not None:
            cpu = on_cpu[rid][1]
            ours = max(abs(a - b) for a, b in zip(got[rid][1], cpu, strict=False))
            theirs = max(abs(a - b) for a, b in zip(logprobs, cpu, strict=False))
            where = f" (max |logprob - CPU transformers|: ours {ours:.2e}, CUDA transformers {theirs:.2e})"
        assert got[rid][0] == tokens, f"request {rid}: tokens differ from transformers{where}"
        torch.testing.assert_close(got[rid][1], logprobs, rtol=1e-3, atol=1e-3, msg=where or None)


def _eager_layers(model: torch.nn.Module) -> None:
    """Switches the fused Triton layer kernels (on by default on CUDA) back to the eager ops."""
    from pytgi_shard.layers.layernorm import RMSNorm
    from pytgi_shard.layers.mlp import GatedMLP

    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.fused = False
        elif isinstance(module, GatedMLP):
            module.kernel_act = None
        elif hasattr(module, "fused_rotary"):
            module.fused_rotary = False


# The families differ in what the layers do (llama: llama3 RoPE scaling; mistral: plain RoPE and
# 4:1 GQA; qwen2: q/k/v bias, tied embeddings), so a mismatch points at its layer.
@pytest.mark.parametrize("kernels", ["fused", "eager"])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_one_rank_matches_transformers_on_cuda(
    tiny_model: Callable[..., Path], attention: str, family: str, kernels: str
) -> None:
    from pytgi_shard.service.startup import load_engine
    from pytgi_shard.settings import ShardSettings

    model = tiny_model(family)
    prompts = encode(model, PROMPTS)
    expected = transformers_greedy(model, prompts, MAX_NEW)
    engine = load_engine(
        ShardSettings(model_path=model, attention=attention, dtype="float32", block_size=BLOCK)
    )
    assert engine.model.device.type == "cuda"
    if kernels == "eager":
        _eager_layers(engine.model)  # type: ignore[arg-type]
    on_cpu = transformers_greedy(model, prompts, MAX_NEW, device="cpu")
    engine.warmup(pb.WarmupRequest(max_prefill_tokens=256, max_batch_total_tokens=4096,
                                   max_batch_size=len(prompts)))

    def call(rpc: str, request: Any) -> Any:
        return engine.prefill(request) if rpc == "Prefill" else engine.decode(request)

    assert_same(collect(call, make_requests(prompts, MAX_NEW)), expected, on_cpu)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_two_ranks_match_transformers_on_cuda(
    tiny_model: Callable[..., Path], attention: str
) -> None:
    # Their fan-out client sends every call to both ranks and checks that the answers agree.
    from tests.integration.test_shard_grpc import Shards, generate, stop
    from tests.shard_process import start_shards

    model = tiny_model("llama")
    prompts = encode(model, PROMPTS)
    expected = transformers_greedy(model, prompts, MAX_NEW)
    extra = ["--attention", attention, "--dtype", "float32", "--block-size", str(BLOCK)]
    shards = Shards(start_shards(model, 2, extra_args=extra))
    try:
        shards.call("Warmup", pb.WarmupRequest(max_prefill_tokens=256, max_batch_total_tokens=4096,
                                               max_batch_size=len(prompts)))
        generations = generate(shards, make_requests(prompts, MAX_NEW))
    finally:
        stop(shards)
    got = {
        rid: ([t for g in gens for t in g.tokens.ids], [x for g in gens for x in g.tokens.logprobs])
        for rid, gens in generations.items()
    }
    assert_same(got, expected)

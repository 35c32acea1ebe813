"""Our models against transformers on the same tiny weights, through the paged cache.

Several prompts of different lengths are prefilled in one flat batch, then a mixed step (one
request continues over its cached prefix with two tokens while the others decode one) and plain
decode steps follow, all over shuffled, non-contiguous block tables. Every position's logits must
equal transformers' full-sequence logits.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import save_file

from pytgi_shard.attention import AttentionMetadata
from pytgi_shard.attention.kv_cache import KVCache
from pytgi_shard.device.distributed import Dist, init_distributed, single_process
from pytgi_shard.models import MODELS, Model, ModelConfig, get_model

CPU = torch.device("cpu")
PROMPT_LENS = [7, 3, 12]
DECODE_STEPS = 4
BLOCK_SIZE = 4
ATOL = 1e-4


def sequences(vocab: int, seed: int = 0) -> list[torch.Tensor]:
    """Each request's full token sequence: its prompt, then the tokens fed while decoding."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n + DECODE_STEPS + 1,), generator=gen) for n in PROMPT_LENS]


# transformers is imported inside the functions that need it: the ranks spawned below import
# this module, and transformers would add seconds to each one's start.


def hf_logits(model_dir: Path, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        return [model(s.unsqueeze(0)).logits[0].float() for s in seqs]


def paged_logits(model: Model, seqs: list[torch.Tensor], seed: int = 0) -> list[torch.Tensor]:
    """Runs `seqs` through `model` (prefill, a mixed step, decode steps); logits per position."""
    lengths = [len(s) for s in seqs]
    needed = [-(-n // BLOCK_SIZE) for n in lengths]
    num_blocks = sum(needed) + 5
    free = list(range(1, num_blocks))  # block 0 is reserved, as in the server
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in needed]
    cache = KVCache.allocate(
        model.num_layers, num_blocks, BLOCK_SIZE, model.num_kv_heads, model.head_dim,
        model.dtype, model.device,
    )
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    done = [0] * len(seqs)

    def step(new: list[int], last_only: bool) -> None:
        ids = torch.cat([s[d : d + n] for s, d, n in zip(seqs, done, new, strict=True)])
        positions = torch.cat([torch.arange(d, d + n) for d, n in zip(done, new, strict=True)])
        meta = AttentionMetadata.build(new, done, tables, BLOCK_SIZE, CPU)
        ends = meta.cu_seqlens_q[1:].long() - 1
        logits = model.forward(ids, positions, cache, meta, ends if last_only else None)
        rows = logits.split([1] * len(new) if last_only else new)
        for i, n in enumerate(new):
            out[i].append(rows[i])
            done[i] += n

    step(PROMPT_LENS, last_only=False)
    step([2] + [1] * (len(seqs) - 1), last_only=True)
    for _ in range(DECODE_STEPS - 1):
        step([1] * len(seqs), last_only=True)
    return [torch.cat(rows) for rows in out]


def positions_seen() -> list[list[int]]:
    """The positions paged_logits returns logits for, per request."""
    seen = []
    for i, n in enumerate(PROMPT_LENS):
        prefill = list(range(n))
        mixed = [n + 1] if i == 0 else [n]
        start = mixed[0] + 1
        seen.append(prefill + mixed + list(range(start, start + DECODE_STEPS - 1)))
    return seen


def assert_matches(ours: list[torch.Tensor], reference: list[torch.Tensor]) -> None:
    for i, (got, full) in enumerate(zip(ours, reference, strict=True)):
        expected = full[positions_seen()[i]]
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0, msg=f"request {i}")


@pytest.mark.parametrize(
    ("family", "sharded"),
    [("llama", False), ("llama", True), ("mistral", False), ("qwen2", False), ("gpt2", False)],
)
def test_logits_match_transformers(
    tiny_model: Callable[..., Path], family: str, sharded: bool
) -> None:
    path = tiny_model(family, sharded=sharded)
    model = get_model(ModelConfig.read(path), dtype=torch.float32, dist=single_process(CPU))
    assert model.model_type == family
    seqs = sequences(model.vocab_size)
    assert_matches(paged_logits(model, seqs), hf_logits(path, seqs))


def test_model_shapes_per_rank(tiny_model: Callable[..., Path]) -> None:
    """Loading needs no communication, so rank 3 of 4 can be built alone to check its shapes."""
    rank3 = Dist(rank=3, world_size=4, device=CPU, group=None)
    mistral = get_model(ModelConfig.read(tiny_model("mistral")), dtype=torch.float32, dist=rank3)
    # One KV head over four ranks: each rank holds a replica of it.
    assert (mistral.num_kv_heads, mistral.head_dim, mistral.vocab_size) == (1, 16, 384)
    llama = get_model(ModelConfig.read(tiny_model("llama")), dtype=torch.bfloat16, dist=rank3)
    assert (llama.num_kv_heads, llama.dtype, llama.max_position_embeddings) == (
        1, torch.bfloat16, 256
    )


def _odd_vocab_llama(path: Path) -> Path:
    """A Llama whose vocabulary (383) does not divide by 2: padded embedding, whole LM head."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama", vocab_size=383, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, port: int, paths: list[Path], out_dir: Path) -> None:
    torch.set_num_threads(1)  # two ranks on a small CI machine: no oversubscription
    dist = init_distributed(rank, 2, "127.0.0.1", port, CPU)
    try:
        results = {}
        for path in paths:
            model = get_model(ModelConfig.read(path), dtype=torch.float32, dist=dist)
            results[path.name] = paged_logits(model, sequences(model.vocab_size))
        torch.save(results, out_dir / f"rank{rank}.pt")
    finally:
        dist.close()


def test_two_ranks_match_one(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    """world_size 2 over gloo: every rank returns the world-size-1 logits.

    World size 1 equals transformers for the tiny families (test_logits_match_transformers); the
    odd-vocabulary model exists only here, so it is also held against transformers here.
    """
    from transformers import AutoConfig

    odd_vocab = _odd_vocab_llama(tmp_path / "odd-vocab")
    paths = [
        tiny_model("llama", sharded=True),  # two KV heads: one per rank
        tiny_model("mistral"),  # one KV head: replicated
        tiny_model("qwen2"),  # q/k/v bias (rank 0's o_proj has none), tied embeddings
        odd_vocab,
    ]
    mp.spawn(_rank_main, args=(_free_port(), paths, tmp_path), nprocs=2, join=True)
    for path in paths:
        seqs = sequences(AutoConfig.from_pretrained(path).vocab_size)
        single = get_model(ModelConfig.read(path), dtype=torch.float32, dist=single_process(CPU))
        expected = paged_logits(single, seqs)
        if path == odd_vocab:
            assert_matches(expected, hf_logits(path, seqs))
        for rank in range(2):
            got = torch.load(tmp_path / f"rank{rank}.pt")[path.name]
            for g, e in zip(got, expected, strict=True):
                torch.testing.assert_close(g, e, atol=1e-5, rtol=0)


def test_sharded_fallback_model_is_refused_naming_the_registry(tmp_path: Path) -> None:
    """An architecture outside the registry cannot shard; the refusal lists what can."""
    (tmp_path / "config.json").write_text('{"model_type": "olmo"}')
    save_file({"w": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    rank0 = Dist(rank=0, world_size=2, device=CPU, group=None)
    with pytest.raises(ValueError, match="Sharded olmo is not supported") as refusal:
        get_model(ModelConfig.read(tmp_path), dtype=torch.float32, dist=rank0)
    assert all(name in str(refusal.value) for name in MODELS)


def test_heads_must_divide_by_world_size(tiny_model: Callable[..., Path]) -> None:
    rank0 = Dist(rank=0, world_size=3, device=CPU, group=None)
    with pytest.raises(ValueError, match="4 attention heads do not split evenly over 3 shards"):
        get_model(ModelConfig.read(tiny_model("llama")), dtype=torch.float32, dist=rank0)


def test_architecture_without_attention_interface_is_refused(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    # GPT-Neo lacks the interface in transformers 4.57 and 5.24 alike (GPT-J gained it in 5).
    config = AutoConfig.for_model("gpt_neo", vocab_size=64, hidden_size=32, num_layers=1,
                                  num_heads=4, attention_types=[[["global"], 1]])
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path, safe_serialization=True)
    with pytest.raises(ValueError, match="gpt_neo cannot be served: .* pluggable attention"):
        get_model(ModelConfig.read(tmp_path), dtype=torch.float32, dist=single_process(CPU))


def test_unloadable_directories_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="has no config.json"):
        get_model(ModelConfig.read(tmp_path), dtype=torch.float32, dist=single_process(CPU))
    (tmp_path / "config.json").write_text('{"model_type": "no-such-model"}')
    with pytest.raises(ValueError, match="no safetensors weights"):
        get_model(ModelConfig.read(tmp_path), dtype=torch.float32, dist=single_process(CPU))
    save_file({"w": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="cannot load the model config"):
        get_model(ModelConfig.read(tmp_path), dtype=torch.float32, dist=single_process(CPU))
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object"):
        get_model(ModelConfig.read(tmp_path), dtype=torch.float32, dist=single_process(CPU))


def test_unknown_attention_backend(tiny_model: Callable[..., Path]) -> None:
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_model(ModelConfig.read(tiny_model("llama")), dtype=torch.float32, dist=single_process(CPU),
                  attention="nope")


def test_dtype_follows_the_flag_then_the_checkpoint_on_gpu_and_float32_on_cpu(
    tiny_model: Callable[..., Path],
) -> None:
    from pytgi_shard.service.startup import resolve_dtype
    from pytgi_shard.settings import ShardSettings

    path = tiny_model("llama")
    config = ModelConfig(path, {**ModelConfig.read(path).raw, "torch_dtype": "float16"})
    settings = ShardSettings(model_path=path)
    assert resolve_dtype(settings, config, CPU) == torch.float32
    assert resolve_dtype(settings, config, torch.device("cuda", 0)) == torch.float16
    flagged = ShardSettings(model_path=path, dtype="bfloat16")
    assert resolve_dtype(flagged, config, torch.device("cuda", 0)) == torch.bfloat16

"""What live LoRA loading and --max-loras eviction cost: on a model directory (default: the
bundled demo model) with a random PEFT adapter of rank R on every projection, the time to read,
check and fuse it (LoadAdapter's worker-thread half), to install it, and to copy it into a device
slot (an eviction's reload: write_slot); and the device bytes of one slot, measured from the
model's wrapped layers, beside the same figure computed for a Llama-3-8B shape.

    python -m pytgi_bench.experiments.lora_live [--model DIR] [--rank 16] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from pytgi_launcher.settings import DEMO_MODEL
from pytgi_proto import generate_pb2 as pb
from pytgi_shard.lora.residency import write_slot
from pytgi_shard.service.startup import load_engine
from pytgi_shard.settings import ShardSettings

MODULES = {"q_proj": ("q", "h"), "k_proj": ("kv", "h"), "v_proj": ("kv", "h"),
           "o_proj": ("h", "q"), "gate_proj": ("i", "h"), "up_proj": ("i", "h"),
           "down_proj": ("h", "i")}
# Llama-3-8B: hidden 4096, 32 heads of 128, 8 KV heads, intermediate 14336, 32 layers.
LLAMA3_8B = {"h": 4096, "q": 4096, "kv": 1024, "i": 14336, "layers": 32}


def write_peft(out: Path, config: dict[str, int], rank: int) -> Path:
    """A random rank-`rank` PEFT adapter on every projection of a Llama-shaped model."""
    tensors = {}
    for layer in range(config["layers"]):
        for module, (o, i) in MODULES.items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, config[i]) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(config[o], rank) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "bias": "none"}))
    return out


def model_shape(model: Path) -> dict[str, int]:
    c = json.loads((model / "config.json").read_text())
    head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return {"h": c["hidden_size"], "q": c["num_attention_heads"] * head,
            "kv": c["num_key_value_heads"] * head, "i": c["intermediate_size"],
            "layers": c["num_hidden_layers"]}


def slot_bytes(shape: dict[str, int], rank: int, element: int) -> int:
    """One slot over q|k|v, o, gate|up, down (attach.py's capacity: rank per fused piece)."""
    h, q, kv, i = shape["h"], shape["q"], shape["kv"], shape["i"]
    per_layer = (3 * rank * (h + q + 2 * kv) + rank * (q + h) + 2 * rank * (h + 2 * i)
                 + rank * (i + h))
    return per_layer * shape["layers"] * element


def median_s(call: Callable[[], object], repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEMO_MODEL)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    engine = load_engine(ShardSettings(model_path=args.model, lora_runtime_updates=True,
                                       max_loras=2, max_lora_rank=args.rank))
    adapters = engine.adapters
    assert adapters.sites is not None
    with tempfile.TemporaryDirectory() as tmp:
        path = write_peft(Path(tmp) / "adapter", model_shape(args.model), args.rank)
        request = pb.LoadAdapterRequest(name="bench", source=str(path), index=1)
        read_s = median_s(lambda: engine.read_adapter(request), args.repeat)
        host = engine.read_adapter(request)

        def install_and_unload() -> None:
            adapters.install(1, host, ())
            adapters.unload(1, ())

        install_s = median_s(install_and_unload, args.repeat)
    copy_s = median_s(lambda: write_slot(adapters.sites, 1, host.pairs), args.repeat)  # type: ignore[arg-type]
    element = torch.empty((), dtype=adapters.dtype).element_size()
    print(f"model {args.model.name} ({adapters.dtype}), rank {args.rank}, device "
          f"{engine.model.device}, median of {args.repeat}")
    print(f"  read + check + fuse (worker thread): {read_s * 1e3:8.2f} ms")
    print(f"  install (+ unload), engine thread:    {install_s * 1e3:8.2f} ms")
    print(f"  copy into a device slot (reload):     {copy_s * 1e3:8.2f} ms")
    print(f"  one slot, measured:  {adapters.sites.slot_bytes() / 2**20:8.2f} MiB "
          f"(formula: {slot_bytes(model_shape(args.model), args.rank, element) / 2**20:.2f})")
    for rank in (16, 64):
        print(f"  one slot, Llama-3-8B, bfloat16, rank {rank}: "
              f"{slot_bytes(LLAMA3_8B, rank, 2) / 2**20:8.1f} MiB")


if __name__ == "__main__":
    main()

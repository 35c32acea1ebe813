"""Random PEFT LoRA adapters for the tiny Llama, written by hand in PEFT's layout (peft is not a
dependency): adapter_config.json and adapter_model.safetensors with PEFT's tensor names
(`base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`), and the
oracle: a copy of the base model with W + scale·B·A merged, for transformers to run."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

SHAPES = {  # module -> (out, in) of the tiny Llama (tests/tiny_models.py)
    "q_proj": ("q", "hidden"), "k_proj": ("kv", "hidden"), "v_proj": ("kv", "hidden"),
    "o_proj": ("hidden", "q"), "gate_proj": ("inter", "hidden"), "up_proj": ("inter", "hidden"),
    "down_proj": ("hidden", "inter"),
    # Phi-3's checkpoint-fused projections.
    "qkv_proj": ("qkv", "hidden"), "gate_up_proj": ("inter2", "hidden"),
}
ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PHI3_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _dims(model: Path) -> dict[str, int]:
    c = json.loads((model / "config.json").read_text())
    head = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return {"hidden": c["hidden_size"], "inter": c["intermediate_size"],
            "q": c["num_attention_heads"] * head, "kv": c["num_key_value_heads"] * head,
            "layers": c["num_hidden_layers"],
            "qkv": (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * head,
            "inter2": 2 * c["intermediate_size"]}


def _section(module: str) -> str:
    return "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj") else "mlp"


def write_adapter(
    out: Path, model: Path, *, rank: int, alpha: float, modules: tuple[str, ...] = ALL_MODULES,
    rslora: bool = False, seed: int = 0, std: float = 0.2, dtype: torch.dtype = torch.float32,
) -> Path:
    """A random adapter (B nonzero, unlike PEFT's initialisation, so that it changes outputs)."""
    dims = _dims(model)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(dims["layers"]):
        for m in modules:
            o, i = SHAPES[m]
            key = f"base_model.model.model.layers.{layer}.{_section(m)}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, dims[i], generator=gen) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(dims[o], rank, generator=gen) * std
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: t.to(dtype) for k, t in tensors.items()}, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(modules),
              "use_rslora": rslora, "bias": "none", "base_model_name_or_path": str(model),
              "task_type": "CAUSAL_LM", "lora_dropout": 0.0, "fan_in_fan_out": False}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def merged_model(out: Path, model: Path, adapter: Path) -> Path:
    """The base model with the adapter merged into its weights: W + scale·B·A."""
    config = json.loads((adapter / "adapter_config.json").read_text())
    rank, alpha = config["r"], config["lora_alpha"]
    scale = alpha / math.sqrt(rank) if config["use_rslora"] else alpha / rank
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    shutil.copytree(model, out)
    weights_file = out / "model.safetensors"
    weights = load_file(str(weights_file))
    for key, a in lora.items():
        if ".lora_A." not in key:
            continue
        b = lora[key.replace(".lora_A.", ".lora_B.")]
        name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        weights[name] = weights[name] + scale * (b.double() @ a.double()).to(weights[name].dtype)
    save_file(weights, str(weights_file), metadata={"format": "pt"})
    return out

"""Which model families a quantization can be served with, checked at start-up before anything
loads, and the log line of the kernels a loaded model's linears run on.

Quantize-on-load (bitsandbytes*, eetq, fp8 of a float checkpoint) applies to every
column/row-parallel linear of pytgi's own families, whatever layout their checkpoint uses: the
model reads a float weight and the format quantizes it. A pre-quantized checkpoint (gptq, awq,
FP8) can only be read where every quantized projection is stored one per name and read through
the checkpoint's LinearLoader: the families below. The others read fused tensors cut by heads
(GPT-2's Conv1D c_attn, NeoX/Falcon/BLOOM's query_key_value, MPT's Wqkv, Phi-3's qkv_proj) or
stacked experts (the MoE families' experts), which no quantized layout maps onto; they are
refused, naming the model type and the method. The transformers fallback is never quantized.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection

from torch import nn

from pytgi_shard.quantization.errors import QuantizationError
from pytgi_shard.quantization.linear_weight import QuantizedWeight
from pytgi_shard.quantization.spec import QuantizationSpec

log = logging.getLogger(__name__)

# model_types whose quantized projections are all read through weights.linear_loader.
PRE_QUANTIZED_FAMILIES = frozenset({
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "starcoder2",
    "granite", "cohere", "opt",
})


def check_model_family(
    model_type: str, spec: QuantizationSpec | None, own_families: Collection[str]
) -> None:
    """A QuantizationError when `model_type` cannot be served with `spec`."""
    if spec is None:
        return
    if model_type not in own_families:
        raise QuantizationError(
            f"{model_type} runs through the transformers fallback, which pytgi does not "
            f"quantize ({spec.method}): quantization needs one of pytgi's own model families "
            f"({', '.join(sorted(own_families))})"
        )
    if spec.pre_quantized and model_type not in PRE_QUANTIZED_FAMILIES:
        raise QuantizationError(
            f"{spec.method} checkpoints of {model_type} are not supported: its linear layers "
            "are stored fused (or as stacked experts), which pytgi reads only from float "
            f"checkpoints; {spec.method} checkpoints are served for "
            f"{', '.join(sorted(PRE_QUANTIZED_FAMILIES))}"
        )


def log_linear_kernels(model: object, model_type: str, spec: QuantizationSpec | None) -> None:
    """One line: the quantization and how many linears run on each QuantizedWeight class (the
    class names the kernel: Int4PackWeight, Fp8Weight, ...). A model with no quantized linear
    at all is refused: its family builds its layers past the LinearFormat, and serving it in
    float under a quantization flag would misreport its memory and /info."""
    if spec is None:
        return
    modules = model.modules() if isinstance(model, nn.Module) else ()
    kernels = Counter(type(m).__name__ for m in modules if isinstance(m, QuantizedWeight))
    if not kernels:
        raise QuantizationError(
            f"{spec.method} did not apply to any linear layer of {model_type}: its layers are "
            "not read through pytgi's quantizable linears; serve it without quantization"
        )
    shown = ", ".join(f"{count} on {name}" for name, count in sorted(kernels.items()))
    log.info("quantization %s: linear layers %s", spec.describe(), shown)

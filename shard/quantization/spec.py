"""QuantizationSpec: what a model's linear weights are, resolved once at start-up from
config.json (and its side files) and --quantize, then handed on as an argument: settings ->
get_model -> the checkpoint's Weights, which pick their LinearFormat from it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QuantizationSpec:
    # The method pytgi runs: gptq, awq, fp8, bitsandbytes, bitsandbytes-nf4, bitsandbytes-fp4,
    # eetq. It is what /info's `quantize` shows.
    method: str
    # Stored quantized in the checkpoint (gptq, awq, FP8 checkpoints), or quantized on load.
    pre_quantized: bool
    # Where it was declared: "--quantize", "config.json `quantization_config`", a side file.
    source: str
    bits: int | None = None
    # Input features per scale (GPTQ/AWQ); None: one group spans all of them (GPTQ's -1).
    group_size: int | None = None
    # GPTQ: act-order, the input rows permuted by g_idx.
    desc_act: bool = False
    # GPTQ: symmetric (zeros fixed at the midpoint) or with stored zeros.
    sym: bool = True
    # AWQ: zero points stored (qzeros).
    zero_point: bool = False
    # gptq: "gptq" (v1, zeros stored minus one) or "gptq_v2"; awq: "gemm"; fp8: "fp8",
    # "fbgemm_fp8" or "compressed-tensors" (how the config declared it; the tensors are alike).
    checkpoint_format: str = ""
    # FP8 weight scales as declared: "tensor" (one per weight) or "channel" (one per output row).
    weight_strategy: str = ""
    # FP8 activations: "dynamic" (scaled per call), "static" (stored input_scale), "" (none,
    # weight-only).
    activation_scheme: str = ""
    # Module names the checkpoint leaves unquantized (AWQ's modules_to_not_convert, ...).
    not_converted: tuple[str, ...] = ()
    # The --quantize value as given when there was one ("marlin" for a GPTQ checkpoint).
    requested: str | None = None

    def describe(self) -> str:
        """One line for the logs: "gptq 4-bit, group size 128, act-order, symmetric, format gptq
        (config.json `quantization_config`)"."""
        parts = [self.method if self.bits is None else f"{self.method} {self.bits}-bit"]
        if self.method in ("gptq", "awq"):
            group = "whole rows" if self.group_size is None else str(self.group_size)
            parts.append(f"group size {group}")
        if self.method == "gptq":
            parts += [
                *(["act-order"] if self.desc_act else []),
                "symmetric" if self.sym else "asymmetric",
            ]
        if self.method == "awq":
            parts.append("zero points" if self.zero_point else "no zero points")
        if self.weight_strategy:
            parts.append(f"per-{self.weight_strategy} weight scales")
        if self.activation_scheme:
            parts.append(f"{self.activation_scheme} activation scales")
        if self.checkpoint_format:
            parts.append(f"format {self.checkpoint_format}")
        kind = "pre-quantized" if self.pre_quantized else "quantized on load"
        return f"{', '.join(parts)} ({kind}, declared by {self.source})"

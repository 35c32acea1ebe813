"""Quantized linear weights: TGI's --quantize modes applied on load, and pre-quantized GPTQ, AWQ
and FP8 checkpoints read as they are stored."""

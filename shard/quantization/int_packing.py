"""Low-bit integers packed into int32 words, as GPTQ and AWQ checkpoints store them.

A word holds 32 / bits values; value j of a word sits at bits [j * bits, (j + 1) * bits) (the
lowest bits first). GPTQ packs its weight along the input features (qweight [in / pack, out]) and
its zeros along the outputs (qzeros [groups, out / pack]), each in that natural order. AWQ's GEMM
layout packs both along the outputs, with the 8 four-bit values of a word in the interleaved order
AWQ_ORDER: the value at position j of a word is output column 8 * word + AWQ_ORDER[j]
(AutoAWQ's WQLinear_GEMM.from_linear; the same order TGI's awq/conversion_utils undoes).
"""

from __future__ import annotations

import torch

# Position j of an AWQ word holds column AWQ_ORDER[j] of its group of 8 outputs.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# The bit widths these packings are read for (3 bits straddle words in GPTQ's layout).
PACKED_BITS = (4, 8)


def values_per_word(bits: int) -> int:
    """How many `bits`-bit values one int32 holds."""
    if bits not in PACKED_BITS:
        raise ValueError(f"{bits}-bit packing is not supported (only {PACKED_BITS})")
    return 32 // bits


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The unsigned `bits`-bit values of int32 words, unpacked along `dim` (which grows by the
    pack factor), as int32."""
    per_word = values_per_word(bits)
    dim = dim % packed.dim()
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    moved = packed.movedim(dim, -1)
    # Arithmetic right shifts of negative words drag sign bits in; the mask drops them.
    values = (moved.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    values = values.reshape(*moved.shape[:-1], moved.shape[-1] * per_word)
    return values.movedim(-1, dim).contiguous()


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The inverse of unpack_int32: unsigned `bits`-bit values along `dim` packed into int32."""
    per_word = values_per_word(bits)
    dim = dim % values.dim()
    moved = values.movedim(dim, -1).to(torch.int64)
    if moved.shape[-1] % per_word:
        raise ValueError(f"{moved.shape[-1]} values do not pack into words of {per_word}")
    if moved.numel() and (moved.min() < 0 or moved.max() >= 1 << bits):
        raise ValueError(f"values outside [0, {1 << bits}) cannot be packed in {bits} bits")
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=values.device)
    grouped = moved.reshape(*moved.shape[:-1], moved.shape[-1] // per_word, per_word)
    words = (grouped << shifts).sum(dim=-1)
    # Words above 2**31 wrap to the negative int32 with the same bits.
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def awq_columns_to_natural(values: torch.Tensor) -> torch.Tensor:
    """Unpacked AWQ columns [..., out] (in word order) -> the outputs in their natural order."""
    out = values.shape[-1]
    if out % len(AWQ_ORDER):
        raise ValueError(f"{out} AWQ columns are not whole words of {len(AWQ_ORDER)}")
    words = values.reshape(*values.shape[:-1], out // len(AWQ_ORDER), len(AWQ_ORDER))
    natural = torch.empty_like(words)
    natural[..., list(AWQ_ORDER)] = words
    return natural.reshape(values.shape)


def natural_columns_to_awq(values: torch.Tensor) -> torch.Tensor:
    """The inverse of awq_columns_to_natural: outputs [..., out] in AWQ's word order."""
    out = values.shape[-1]
    if out % len(AWQ_ORDER):
        raise ValueError(f"{out} outputs are not whole AWQ words of {len(AWQ_ORDER)}")
    words = values.reshape(*values.shape[:-1], out // len(AWQ_ORDER), len(AWQ_ORDER))
    return words[..., list(AWQ_ORDER)].reshape(values.shape)

"""The int32 packings of GPTQ and AWQ: pytgi's unpacker against the bit-loop packers written from
the documented layouts (tests/int_quantized_checkpoints.py), and its own packer against them."""

from __future__ import annotations

import pytest
import torch

from pytgi_shard.quantization.int_packing import (
    awq_columns_to_natural,
    natural_columns_to_awq,
    pack_int32,
    unpack_int32,
    values_per_word,
)
from tests.int_quantized_checkpoints import AWQ_ORDER, pack_cols, pack_rows


@pytest.mark.parametrize("bits", [4, 8])
def test_unpack_reads_the_bit_loop_packing_along_rows_and_columns(bits: int) -> None:
    values = torch.randint(0, 1 << bits, (16, 24), generator=torch.Generator().manual_seed(bits))
    assert torch.equal(unpack_int32(pack_rows(values, bits), bits, dim=0), values.int())
    assert torch.equal(unpack_int32(pack_cols(values, bits), bits, dim=1), values.int())


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_writes_the_bit_loop_packing(bits: int) -> None:
    values = torch.randint(0, 1 << bits, (16, 8), generator=torch.Generator().manual_seed(7))
    assert torch.equal(pack_int32(values, bits, dim=0), pack_rows(values, bits))
    assert torch.equal(pack_int32(values, bits, dim=1), pack_cols(values, bits))


def test_top_bits_set_words_round_trip() -> None:
    """A high value in the last slot sets the int32 sign bit: no sign bits may leak back."""
    values = torch.full((8, 1), 15)
    words = pack_rows(values, 4)
    assert int(words[0, 0]) == -1
    assert torch.equal(unpack_int32(words, 4, dim=0), values.int())


def test_awq_interleaved_columns_come_back_in_order() -> None:
    values = torch.arange(16).remainder(16).reshape(1, 16)
    words = pack_cols(values, 4, AWQ_ORDER)
    # Word 0 holds outputs 0, 2, 4, 6, 1, 3, 5, 7 from its lowest nibble up.
    assert [(int(words[0, 0]) >> (4 * j)) & 15 for j in range(8)] == AWQ_ORDER
    assert torch.equal(awq_columns_to_natural(unpack_int32(words, 4, dim=1)), values.int())


def test_unsupported_widths_and_values_are_refused() -> None:
    with pytest.raises(ValueError, match="3-bit"):
        values_per_word(3)
    with pytest.raises(ValueError, match="outside"):
        pack_int32(torch.full((8, 1), 16), 4, dim=0)
    with pytest.raises(ValueError, match="do not pack"):
        pack_int32(torch.zeros(6, 1, dtype=torch.int64), 4, dim=0)


def test_natural_columns_pack_into_awq_words() -> None:
    values = torch.randint(0, 16, (3, 24), generator=torch.Generator().manual_seed(3))
    words = pack_int32(natural_columns_to_awq(values), 4, dim=1)
    assert torch.equal(words, pack_cols(values, 4, AWQ_ORDER))
    assert torch.equal(natural_columns_to_awq(awq_columns_to_natural(values)), values)

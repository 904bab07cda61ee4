"""ZeRO++ messages: quantized rows and their scales travel as one byte buffer per peer."""

from __future__ import annotations

import pytest
import torch

from hf_zero.comm.quantized import pack, unpack
from hf_zero.numerics.quant import dequantize_rows, quantize_rows


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel", [512, 300, 6])  # whole blocks, a part block, a payload of 3 bytes
def test_pack_then_unpack_gives_back_every_byte(bits, numel):
    torch.manual_seed(0)
    q = quantize_rows(torch.randn(3, numel), bits, block_size=256)
    packed = pack(q)
    assert packed.dtype == torch.uint8 and packed.shape[0] == 3
    assert packed.shape[1] % 4 == 0 and packed.shape[1] - q.nbytes // 3 < 4  # padding only
    back = unpack(packed, q)
    assert torch.equal(back.data, q.data) and torch.equal(back.scales, q.scales)
    assert (back.numel, back.bits, back.block_size) == (q.numel, q.bits, q.block_size)
    assert torch.equal(dequantize_rows(back), dequantize_rows(q))


def test_unpacked_rows_of_a_gathered_buffer_are_views_of_it():
    """A gather receives every rank's packed rows into one buffer; the rows read from it are
    views, so nothing is copied after the bytes arrive."""
    torch.manual_seed(0)
    q = quantize_rows(torch.randn(1, 700), 8, block_size=256)
    gathered = torch.cat([pack(q), pack(quantize_rows(torch.randn(1, 700), 8, 256))])
    rows = unpack(gathered, q)
    assert rows.data.data_ptr() == gathered.data_ptr()
    assert torch.equal(rows.data[0], q.data[0]) and torch.equal(rows.scales[0], q.scales[0])
    gathered[0, 0] = 7  # the first payload byte: the first quantized value
    assert rows.data[0, 0].item() == 7

"""Blockwise INT8/INT4 quantization: round-trip error within half a quantization step, for
bf16, fp16 and fp32 inputs, sizes that do not divide the block, and all-zero blocks."""

import pytest
import torch

from hf_zero.numerics.quant import (
    QMAX,
    dequantize,
    dequantize_rows,
    fitted_block_size,
    quantize,
    quantize_rows,
)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [64, 256])
def test_round_trip_within_half_a_step(bits, dtype, block_size):
    torch.manual_seed(0)
    # Blocks of very different magnitudes, a size that needs padding, and an all-zero block.
    x = torch.randn(10_001) * torch.logspace(-3, 2, 10_001)
    x[:block_size] = 0
    x = x.to(dtype)
    q = quantize(x, bits=bits, block_size=block_size)
    back = dequantize(q, torch.float32)
    assert back.shape == (x.numel(),)
    exact = x.float()
    step = q.scales.repeat_interleave(block_size)[: x.numel()]
    # Half a step, plus fp32 rounding of the scale products (a few ulps of |x|).
    assert torch.all((back - exact).abs() <= step / 2 + exact.abs() * 1e-6 + 1e-30)
    assert torch.equal(back[:block_size], torch.zeros(block_size))
    # Relative error of the whole tensor, as the quantized all-gather will see it.
    rel = ((back - exact).norm() / exact.norm()).item()
    assert rel < {8: 0.01, 4: 0.15}[bits]
    assert back.abs().max() <= exact.abs().max() * (1 + 1e-6)
    assert dequantize(q, dtype).dtype == dtype


def test_rows_are_quantized_independently():
    """The collectives send row j to rank j: a row's blocks must not depend on other rows."""
    torch.manual_seed(0)
    x = torch.randn(3, 1000) * torch.tensor([[1e-3], [1.0], [1e3]])
    q = quantize_rows(x, 8, 64)
    assert q.data.shape == (3, 1024) and q.scales.shape == (3, 16)  # each row padded alone
    back = dequantize_rows(q)
    for i in range(3):
        alone = dequantize(quantize(x[i], 8, 64))
        assert torch.equal(back[i], alone)
    assert fitted_block_size(40, 256) == 40 and fitted_block_size(41, 256) == 42
    assert fitted_block_size(5000, 256) == 256


def test_payload_sizes():
    x = torch.randn(1000)
    q8, q4 = quantize(x, 8, 100), quantize(x, 4, 100)
    assert q8.data.dtype == torch.int8 and q8.data.numel() == 1000
    assert q4.data.dtype == torch.uint8 and q4.data.numel() == 500  # two values per byte
    assert q8.scales.numel() == q4.scales.numel() == 10
    assert q8.nbytes == 1000 + 40 and q4.nbytes == 500 + 40
    assert int(quantize(torch.tensor([1.0, -1.0]), 8, 2).data.abs().max()) == QMAX[8]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="bits = 3; allowed: 8, 4"):
        quantize(torch.zeros(4), bits=3)
    with pytest.raises(ValueError, match="block_size = 3 must be an even integer"):
        quantize(torch.zeros(4), block_size=3)


def _one_pass(x: torch.Tensor, bits: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The formula in one vectorised pass over the whole (padded) rows: the reference."""
    qmax = QMAX[bits]
    flat = torch.nn.functional.pad(x.float(), (0, -x.shape[1] % block_size))
    blocks = flat.view(x.shape[0], -1, block_size)
    scales = blocks.abs().amax(dim=2, keepdim=True) / qmax
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    ints = torch.round(blocks / safe).clamp_(-qmax, qmax).to(torch.int8)
    return ints.view(x.shape[0], -1), scales.view(x.shape[0], -1)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_work_equals_the_one_pass_formula_bit_for_bit(monkeypatch, bits, dtype):
    """Chunk boundaries (forced small here) and transposed inputs change nothing."""
    import hf_zero.numerics.quant as quant

    monkeypatch.setattr(quant, "CHUNK_ELEMENTS", 192)  # 3 blocks of 64 per chunk
    torch.manual_seed(0)
    full = (torch.randn(2, 3, 1000) * torch.logspace(-2, 2, 1000)).to(dtype)
    x = full.transpose(0, 1)  # [3, 2, 1000]: rows taken in row-major order, not copied
    q = quantize_rows(x, bits, 64)
    ints, scales = _one_pass(x.reshape(6, 1000), bits, 64)
    assert torch.equal(q.scales, scales)
    back_ints = quant._values(q, slice(None), 0, q.scales.shape[1] * 64)
    assert torch.equal(back_ints, ints)
    expected = (ints.view(6, -1, 64).float() * scales.unsqueeze(-1)).view(6, -1)[:, :1000]
    assert torch.equal(dequantize_rows(q), expected)
    assert torch.equal(dequantize_rows(q, dtype), expected.to(dtype))
    acc = torch.ones(6, 1000)
    quant.dequantize_rows_into(q, acc, accumulate=True)
    assert torch.equal(acc, expected + 1)

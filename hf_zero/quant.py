"""Blockwise symmetric INT8 / INT4 quantization in pure torch (any device, any float dtype).

A flat tensor is cut into blocks of ``block_size`` elements (the last one zero-padded); each
block gets one fp32 scale ``absmax / qmax`` and its elements are rounded to integers in
``[-qmax, qmax]`` (127 for INT8, 7 for INT4). INT4 values are packed two per byte. Arithmetic
is done in fp32 whatever the input dtype, so bf16 and fp16 inputs quantize as accurately as
fp32 ones (the reference implementation's kernels accept fp16 only).

Error bound, per element: ``|x - dequantize(quantize(x))| <= scale / 2`` of its block (plus the
rounding of the output dtype).

The row-wise form (`quantize_rows`) quantizes each row of a 2-D tensor on its own, padding each
row to whole blocks: the ZeRO++ collectives send row ``j`` to rank ``j``, so no block may straddle
two destinations. Everything is vectorised over rows and blocks; there are no Python loops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QMAX = {8: 127, 4: 7}


@dataclass
class Quantized:
    """Quantized rows: integer payload, per-block fp32 scales, and how to undo it.

    ``data`` is ``[rows, bytes_per_row]`` (int8 for INT8, uint8 holding two 4-bit values for
    INT4), ``scales`` is ``[rows, blocks_per_row]``; each row stands for ``numel`` values.
    """

    data: torch.Tensor
    scales: torch.Tensor
    numel: int
    bits: int
    block_size: int

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel() * 4


def check_quant_args(bits: int, block_size: int, where: str = "quantize") -> None:
    """Raise ``ValueError`` for a bit width or block size the quantizer cannot use."""
    if bits not in QMAX:
        raise ValueError(f"{where}: bits = {bits!r}; allowed: 8, 4")
    if not isinstance(block_size, int) or block_size < 2 or block_size % 2:
        raise ValueError(f"{where}: block_size = {block_size!r} must be an even integer >= 2")


def fitted_block_size(numel: int, block_size: int) -> int:
    """``block_size``, or less when a row is shorter: a 40-element row is not padded to 256."""
    return min(block_size, max(2, numel + numel % 2))


def quantize_rows(x: torch.Tensor, bits: int = 8, block_size: int = 256) -> Quantized:
    """Quantize each row of the 2-D tensor ``x`` blockwise to ``bits`` (8 or 4)."""
    check_quant_args(bits, block_size)
    qmax = QMAX[bits]
    rows, numel = x.shape
    flat = x.detach().float()
    pad = -numel % block_size
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    blocks = flat.view(rows, -1, block_size)
    scales = blocks.abs().amax(dim=2, keepdim=True) / qmax
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / safe).clamp_(-qmax, qmax).to(torch.int8).view(rows, -1)
    if bits == 4:
        nibbles = (q + 8).to(torch.uint8).view(rows, -1, 2)  # offset to 1..15, two per byte
        data = nibbles[..., 0] | (nibbles[..., 1] << 4)
    else:
        data = q
    return Quantized(data, scales.view(rows, -1), numel, bits, block_size)


def dequantize_rows(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``[rows, numel]`` tensor ``q`` stands for, in ``dtype``."""
    rows = q.data.shape[0]
    if q.bits == 4:
        low = (q.data & 0x0F).to(torch.int16) - 8
        high = (q.data >> 4).to(torch.int16) - 8
        values = torch.stack([low, high], dim=2).view(rows, -1)
    else:
        values = q.data
    blocks = values.view(rows, -1, q.block_size).float() * q.scales.view(rows, -1, 1)
    return blocks.view(rows, -1)[:, : q.numel].to(dtype)


def quantize(x: torch.Tensor, bits: int = 8, block_size: int = 256) -> Quantized:
    """Quantize ``x`` (flattened) blockwise to ``bits`` (8 or 4); one row."""
    return quantize_rows(x.reshape(1, -1), bits, block_size)


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The flat tensor a one-row ``q`` stands for, in ``dtype``."""
    return dequantize_rows(q, dtype).view(-1)

"""Blockwise symmetric INT8 / INT4 quantization in pure torch (any device, any float dtype).

A flat tensor is cut into blocks of ``block_size`` elements (the last one zero-padded); each
block gets one fp32 scale ``absmax / qmax`` and its elements are rounded to integers in
``[-qmax, qmax]`` (127 for INT8, 7 for INT4). INT4 values are packed two per byte. Arithmetic
is done in fp32 whatever the input dtype, so bf16 and fp16 inputs quantize as accurately as
fp32 ones (the reference implementation's kernels accept fp16 only).

Error bound, per element: ``|x - dequantize(quantize(x))| <= scale / 2`` of its block (plus the
rounding of the output dtype). These are the building blocks for ZeRO++ (qwZ, qgZ) and MixZ++,
which are not implemented yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QMAX = {8: 127, 4: 7}


@dataclass
class Quantized:
    """A quantized flat tensor: integer payload, per-block fp32 scales, and how to undo it."""

    data: torch.Tensor  # int8 (INT8) or uint8 holding two 4-bit values (INT4)
    scales: torch.Tensor  # fp32, one per block
    numel: int
    bits: int
    block_size: int

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel() * 4


def quantize(x: torch.Tensor, bits: int = 8, block_size: int = 256) -> Quantized:
    """Quantize ``x`` (flattened) blockwise to ``bits`` (8 or 4)."""
    if bits not in QMAX:
        raise ValueError(f"quantize: bits = {bits!r}; allowed: 8, 4")
    if block_size < 2 or block_size % 2:
        raise ValueError(f"quantize: block_size = {block_size!r} must be an even integer >= 2")
    qmax = QMAX[bits]
    flat = x.detach().reshape(-1).float()
    numel = flat.numel()
    pad = -numel % block_size
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    blocks = flat.view(-1, block_size)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    scales = absmax / qmax
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / safe).clamp_(-qmax, qmax).to(torch.int8)
    if bits == 4:
        nibbles = (q + 8).to(torch.uint8).view(-1, 2)  # offset to 1..15, two per byte
        data = nibbles[:, 0] | (nibbles[:, 1] << 4)
    else:
        data = q.view(-1)
    return Quantized(data, scales.view(-1), numel, bits, block_size)


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The flat tensor ``q`` stands for, in ``dtype``."""
    if q.bits == 4:
        low = (q.data & 0x0F).to(torch.int16) - 8
        high = (q.data >> 4).to(torch.int16) - 8
        values = torch.stack([low, high], dim=1).view(-1)
    else:
        values = q.data
    blocks = values.view(-1, q.block_size).float() * q.scales.view(-1, 1)
    return blocks.view(-1)[: q.numel].to(dtype)

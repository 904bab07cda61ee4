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
two destinations. Work goes chunk by chunk (`CHUNK_ELEMENTS`), vectorised inside a chunk, into
outputs allocated once.
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
    format: str = "int"
    """``"int"``: this module's symmetric blocks; ``"nf4"``/``"fp4"``: bitsandbytes' 4-bit
    codes with one absmax per block (`hf_zero.numerics.quant`)."""

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


CHUNK_ELEMENTS = 1 << 18
"""Elements processed at a time (whole blocks). Temporaries of this size stay in cache and come
from the heap; whole-buffer temporaries of tens of MB are mmap'd fresh by the allocator on every
call, and their page faults cost more than the arithmetic (measured 3x on a 19M-element
dequantize)."""


def _rows(x: torch.Tensor) -> list[torch.Tensor]:
    """The last-dim rows of ``x``, in row-major order, as views (no copy)."""
    if x.dim() == 1:
        return [x]
    return [row for sub in x.unbind(0) for row in _rows(sub)]


def _chunks(numel: int, block_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` element ranges of whole blocks (the last one may end in a part block)."""
    step = max(block_size, CHUNK_ELEMENTS // block_size * block_size)
    return [(s, min(s + step, numel)) for s in range(0, numel, step)]


def _slice(segments: list[torch.Tensor], start: int, end: int) -> torch.Tensor:
    """Elements ``[start, end)`` of the concatenation of ``segments``, in fp32."""
    parts, offset = [], 0
    for seg in segments:
        lo, hi = max(start, offset), min(end, offset + seg.numel())
        if lo < hi:
            parts.append(seg[lo - offset : hi - offset])
        offset += seg.numel()
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).detach().float()


def quantize_rows(x: torch.Tensor, bits: int = 8, block_size: int = 256) -> Quantized:
    """Quantize each row of the 2-D tensor ``x`` blockwise to ``bits`` (8 or 4)."""
    return quantize_segments([[row] for row in _rows(x)], bits, block_size)


def quantize_segments(
    rows: list[list[torch.Tensor]], bits: int = 8, block_size: int = 256
) -> Quantized:
    """Quantize rows given as lists of 1-D pieces, each row the concatenation of its pieces
    (all rows equally long), without building the concatenation: qgZ's rows are strided
    pieces of the flat gradient."""
    check_quant_args(bits, block_size)
    qmax = QMAX[bits]
    numel = sum(seg.numel() for seg in rows[0])
    blocks_per_row = -(-numel // block_size)
    padded = blocks_per_row * block_size
    device = rows[0][0].device
    values = torch.empty(len(rows), padded, dtype=torch.int8, device=device)
    scales = torch.empty(len(rows), blocks_per_row, dtype=torch.float32, device=device)
    for r, segments in enumerate(rows):
        for start, end in _chunks(numel, block_size):
            chunk = _slice(segments, start, end)
            if (end - start) % block_size:  # the row's last, part block: zero-padded
                chunk = torch.nn.functional.pad(chunk, (0, -(end - start) % block_size))
            blocks = chunk.view(-1, block_size)
            scale = blocks.abs().amax(dim=1, keepdim=True).div_(qmax)
            scales[r, start // block_size : start // block_size + blocks.shape[0]] = scale[:, 0]
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            # |x| <= absmax = scale * qmax, so the rounded quotient is within [-qmax, qmax].
            quotient = torch.div(blocks, safe).round_()
            values[r, start : start + quotient.numel()].copy_(quotient.view(-1))
    if bits == 4:
        nibbles = (values + 8).to(torch.uint8).view(len(rows), -1, 2)  # 1..15, two per byte
        data = nibbles[..., 0] | (nibbles[..., 1] << 4)
    else:
        data = values
    return Quantized(data, scales, numel, bits, block_size)


def _values(q: Quantized, rows: slice, start: int, end: int) -> torch.Tensor:
    """The integers of elements ``[start, end)`` (whole blocks) of ``rows``, unpacked."""
    if q.bits == 8:
        return q.data[rows, start:end]
    packed = q.data[rows, start // 2 : end // 2]
    low = (packed & 0x0F).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack([low, high], dim=-1).flatten(-2)


def dequantize_rows_into(q: Quantized, out: torch.Tensor, accumulate: bool = False) -> None:
    """Write (``accumulate``: add) the ``[rows, numel]`` values ``q`` stands for into ``out``
    (any float dtype, viewable as ``[rows, numel]``), chunk by chunk, with no whole-size
    temporary. Writing is bit-identical to ``dequantize_rows(q, out.dtype)``."""
    if q.format != "int":
        return dequantize_bnb_into(q, out, accumulate)
    rows = q.data.shape[0]
    out = out.view(rows, q.numel)
    bs = q.block_size
    padded = q.scales.shape[1] * bs
    for start, end in _chunks(padded, bs):
        blocks = (end - start) // bs
        scale = q.scales[:, start // bs : start // bs + blocks].unsqueeze(-1)
        ints = _values(q, slice(None), start, end).view(rows, blocks, bs)
        stop = min(end, q.numel)
        if stop <= start:
            break
        target = out[:, start:stop]
        if accumulate or stop < end or out.dtype != torch.float32:
            values = ints.float().mul_(scale).view(rows, -1)[:, : stop - start]
            if accumulate:
                target.add_(values)
            else:
                target.copy_(values)
        else:
            target = target.view(rows, blocks, bs)
            target.copy_(ints)
            target.mul_(scale)


def dequantize_rows(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``[rows, numel]`` tensor ``q`` stands for, in ``dtype``."""
    out = torch.empty(q.data.shape[0], q.numel, dtype=dtype, device=q.data.device)
    dequantize_rows_into(q, out)
    return out


def quantize(x: torch.Tensor, bits: int = 8, block_size: int = 256) -> Quantized:
    """Quantize ``x`` (flattened) blockwise to ``bits`` (8 or 4); one row."""
    return quantize_rows(x.reshape(1, -1), bits, block_size)


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The flat tensor a one-row ``q`` stands for, in ``dtype``."""
    return dequantize_rows(q, dtype).view(-1)


# --- bitsandbytes' 4-bit formats ----------------------------------------------------------------
# MixZ++ in bitsandbytes' 4-bit formats: a flat shard as NF4/FP4 codes with one absmax each
# 64 values, made and read with bitsandbytes' own functions (the format QLoRA bases use).
#
# A shard is one row of a `Quantized` (``format`` ``"nf4"``/``"fp4"``): ``data`` the packed codes
# (two per byte), ``scales`` the fp32 absmax per block; a shard whose length is not a multiple of
# the block is zero-padded for quantizing and cut back on dequantizing. bitsandbytes is imported
# only when these formats are used.

BNB_FORMATS = ("nf4", "fp4")
BNB_BLOCK = 64
"""Values per absmax (bitsandbytes' default block size for 4-bit weights)."""


def quantize_bnb(shard: torch.Tensor, kind: str) -> Quantized:
    """``shard`` (flat, any float dtype) as one row of ``kind`` codes."""
    import bitsandbytes.functional as F

    if kind not in BNB_FORMATS:
        raise ValueError(f"hf_zero: 4-bit format {kind!r}; allowed: {', '.join(BNB_FORMATS)}")
    numel = shard.numel()
    padded = -(-numel // BNB_BLOCK) * BNB_BLOCK
    values = torch.nn.functional.pad(shard.detach().float().reshape(-1), (0, padded - numel))
    codes, state = F.quantize_4bit(
        values, blocksize=BNB_BLOCK, quant_type=kind, quant_storage=torch.uint8
    )
    return Quantized(codes.view(1, -1), state.absmax.view(1, -1), numel, 4, BNB_BLOCK, kind)


def dequantize_bnb_into(q: Quantized, out: torch.Tensor, accumulate: bool = False) -> None:
    """Write (``accumulate``: add) the ``[rows, numel]`` values of ``q`` into ``out``."""
    import bitsandbytes.functional as F

    rows = q.data.shape[0]
    out = out.view(rows, q.numel)
    padded = q.scales.shape[1] * q.block_size
    code = F.get_4bit_type(q.format, device=q.data.device)
    for r in range(rows):
        state = F.QuantState(
            absmax=q.scales[r].contiguous(),
            shape=torch.Size([padded]),
            code=code,
            blocksize=q.block_size,
            quant_type=q.format,
            dtype=torch.float32,
        )
        values = F.dequantize_4bit(q.data[r].contiguous().view(-1, 1), state).reshape(-1)
        values = values[: q.numel]
        if accumulate:
            out[r].add_(values)
        else:
            out[r].copy_(values)

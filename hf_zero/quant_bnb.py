"""MixZ++ in bitsandbytes' 4-bit formats: a flat shard as NF4/FP4 codes with one absmax each
64 values, made and read with bitsandbytes' own functions (the format QLoRA bases use).

A shard is one row of a `Quantized` (``format`` ``"nf4"``/``"fp4"``): ``data`` the packed codes
(two per byte), ``scales`` the fp32 absmax per block; a shard whose length is not a multiple of
the block is zero-padded for quantizing and cut back on dequantizing. bitsandbytes is imported
only when these formats are used.
"""

from __future__ import annotations

import torch

from hf_zero.quant import Quantized

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

"""MixZ++: a frozen group's shard kept only quantized (INT8/INT4 blocks, or bitsandbytes'
NF4/FP4), quantized once from fp32 values."""

from __future__ import annotations

import torch

from hf_zero.comm import quantize_shard
from hf_zero.numerics.quant import Quantized
from hf_zero.sharding.tiers.device import Tier


def quantize_frozen(values: torch.Tensor, kind: str, bits: int, block_size: int) -> Quantized:
    """One MixZ++ shard: hf_zero's ``bits``-bit blocks (``kind`` ``"int"``), or bitsandbytes'
    NF4/FP4 (64-value blocks). `hf_zero.integrations.reload` replays the same call."""
    if kind == "int":
        return quantize_shard(values, bits, block_size)
    from hf_zero.numerics.quant import quantize_bnb

    return quantize_bnb(values, kind)


class QuantizedTier(Tier):
    """The shard as `Quantized` rows (``quantized_params`` in `memory_report()`); gathers
    all-gather the INT8 rows and dequantize. ``context`` is the `ZeroPPSettings`."""

    kind = "quantized_params"
    permanent = True

    def __init__(self, values: torch.Tensor, device: torch.device, context=None) -> None:
        self.bits, self.block_size = context.weight_bits, context.block_size
        self.format = context.frozen_format
        self.data: Quantized = quantize_frozen(values, self.format, self.bits, self.block_size)

    def fetch(self) -> Quantized:
        return self.data

    def write_(self, values: torch.Tensor, start: int = 0, non_blocking: bool = False) -> None:
        """Re-quantize from new values (only whole shards: `FlatParamGroup.broadcast_from`)."""
        if start != 0 or values.numel() != self.data.numel:
            raise ValueError("hf_zero: a quantized shard is only ever replaced whole")
        self.data = quantize_frozen(values, self.format, self.bits, self.block_size)

    def held_bytes(self) -> dict[str, int]:
        return {self.kind: self.data.nbytes}

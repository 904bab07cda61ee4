"""Collectives with byte accounting, and the ZeRO++ quantized variants."""

from hf_zero.comm.collectives import Collectives, CommStats
from hf_zero.comm.quantized import (
    QuantizedGather,
    QuantizedReduceScatter,
    ZeroPPSettings,
    quantize_shard,
)

__all__ = [
    "Collectives",
    "CommStats",
    "QuantizedGather",
    "QuantizedReduceScatter",
    "ZeroPPSettings",
    "quantize_shard",
]

"""Stochastic rounding of fp32 values to bf16, reproducibly.

A bf16 master weight keeps 8 bits of mantissa: an update smaller than half a unit in the last
place (a norm weight of 1.0 moved by 1e-3) rounds away to nothing at every step when rounded to
nearest. Rounding up with probability equal to the discarded fraction keeps every update in
expectation, which is what lets bf16 master weights train like fp32 ones. The random bits come
from a generator seeded by the caller (the optimizer step and which shard), so a run that
resumes from a checkpoint draws the same bits as one that never stopped.
"""

from __future__ import annotations

import torch


def to_bf16_stochastic(values: torch.Tensor, seed: int) -> torch.Tensor:
    """``values`` (fp32) rounded to bf16: up in magnitude with the probability of the
    discarded low 16 bits, else down; non-finite values as ``to(bfloat16)`` gives them."""
    generator = torch.Generator(device=values.device).manual_seed(seed)
    noise = torch.randint(
        0, 1 << 16, values.shape, dtype=torch.int32, device=values.device, generator=generator
    )
    # fp32 is sign and magnitude: adding to the bit pattern moves the magnitude away from zero
    # for either sign, carrying into the exponent when the mantissa overflows.
    bits = (values.contiguous().view(torch.int32) + noise) & -65536
    rounded = bits.view(torch.float32).to(torch.bfloat16)  # exact: the low 16 bits are zero
    return torch.where(torch.isfinite(values), rounded, values.to(torch.bfloat16))

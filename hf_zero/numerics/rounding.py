"""Stochastic rounding of fp32 values to bf16, reproducibly and by position.

A bf16 master weight keeps 8 bits of mantissa: an update smaller than half a unit in the last
place (a norm weight of 1.0 moved by 1e-3) rounds away to nothing at every step when rounded to
nearest. Rounding up with probability equal to the discarded fraction keeps every update in
expectation, which is what lets bf16 master weights train like fp32 ones.

The random bits come from generators seeded by the caller's seed (the optimizer step and which
shard), so a run that resumes from a checkpoint draws the same bits as one that never stopped.
They are drawn in blocks of `NOISE_BLOCK` elements, each block from a generator of its own, so
an element's bits depend only on its position in the shard: a step that rounds its shard tile
by tile (ZeRO-Infinity's streamed step) rounds every element as a step over the whole shard does.
"""

from __future__ import annotations

import torch

NOISE_BLOCK = 1 << 16
"""Elements per generator: a tile that starts or ends inside a block draws that block whole."""

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64's finaliser: neighbouring inputs give unrelated outputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _block_seed(seed: int, block: int) -> int:
    # torch's CPU generator keeps 32 bits of a seed: fold all 64 into them.
    mixed = _mix64(_mix64(seed & _MASK64) ^ block)
    return (mixed ^ (mixed >> 32)) & 0xFFFFFFFF


def rounding_noise(seed: int, offset: int, numel: int, device: torch.device) -> torch.Tensor:
    """16 random bits (int32 in ``[0, 2^16)``) for each of the elements ``[offset, offset +
    numel)`` of a shard: the same bits for an element whatever range it is asked in."""
    first, last = offset // NOISE_BLOCK, (offset + numel - 1) // NOISE_BLOCK
    blocks = []
    generator = torch.Generator(device=device)
    for block in range(first, last + 1):
        generator.manual_seed(_block_seed(seed, block))
        blocks.append(
            torch.randint(0, 1 << 16, (NOISE_BLOCK,), dtype=torch.int32, device=device,
                          generator=generator)
        )  # fmt: skip
    start = offset - first * NOISE_BLOCK
    noise = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
    return noise[start : start + numel]


def to_bf16_stochastic(values: torch.Tensor, seed: int, offset: int = 0) -> torch.Tensor:
    """``values`` (fp32; elements ``offset ..`` of a shard) rounded to bf16: up in magnitude
    with the probability of the discarded low 16 bits, else down; non-finite values as
    ``to(bfloat16)`` gives them."""
    if values.numel() == 0:
        return values.to(torch.bfloat16)
    noise = rounding_noise(seed, offset, values.numel(), values.device).view(values.shape)
    # fp32 is sign and magnitude: adding to the bit pattern moves the magnitude away from zero
    # for either sign, carrying into the exponent when the mantissa overflows.
    bits = (values.contiguous().view(torch.int32) + noise) & -65536
    rounded = bits.view(torch.float32).to(torch.bfloat16)  # exact: the low 16 bits are zero
    return torch.where(torch.isfinite(values), rounded, values.to(torch.bfloat16))


class ShardRounding:
    """The rounding of one shard's bf16 master after each optimizer step: seeded by the shard
    (``salt``, the same in every run of the model) and the step (the optimizer's ``step``
    state, else a count kept here), so each step draws new bits and a resumed run the same."""

    def __init__(self, salt: int) -> None:
        self.salt = salt
        self.steps = 0
        """Steps begun: the seed's count for optimizers that keep no ``step`` state."""

    def begin_step(self) -> None:
        """Call once per optimizer step of the shard, before its first `round`."""
        self.steps += 1

    def round(self, values: torch.Tensor, state: dict, offset: int = 0) -> torch.Tensor:
        """``values`` (the stepped fp32 elements ``offset ..`` of the shard) in bf16;
        ``state``: the shard's optimizer state after the step."""
        step = int(state.get("step", self.steps))
        return to_bf16_stochastic(values, (self.salt * 1_000_003 + step) % (1 << 63), offset)

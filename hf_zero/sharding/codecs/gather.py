"""Gather codecs: assemble a stage-3 group's full buffer from every rank's shard."""

from __future__ import annotations

import torch

from hf_zero.comm import Collectives, QuantizedGather, ZeroPPSettings, quantize_shard
from hf_zero.comm.topology import Group
from hf_zero.numerics.quant import Quantized
from hf_zero.sharding.tiers import Tier


class NoGather:
    """Stages 0-2: the full parameters are held all the time; nothing is gathered or kept."""

    def launch(self, out: torch.Tensor, tier: Tier, async_op: bool):
        raise RuntimeError("hf_zero: stages 0-2 hold the full parameters: nothing to gather")

    def finish(self, out: torch.Tensor, work) -> None:
        """Nothing to keep."""

    def release(self, permanent_too: bool = False) -> None:
        """Nothing kept."""

    def held_bytes(self) -> int:
        return 0


class ExactGather:
    """All-gather what the tier holds: 16-bit shards, or a MixZ++ tier's INT8 rows."""

    def __init__(self, comm: Collectives, group: Group, settings: ZeroPPSettings) -> None:
        self.comm, self.group, self.settings = comm, group, settings

    def launch(self, out: torch.Tensor, tier: Tier, async_op: bool):
        """Start filling ``out`` (the full buffer); returns the work to ``wait()`` on."""
        shard = tier.fetch()
        if isinstance(shard, Quantized):
            return QuantizedGather(self.comm, out, shard, self.group, async_op)
        return self.comm.all_gather(out, shard, self.group, async_op=async_op)

    def finish(self, out: torch.Tensor, work) -> None:
        """After ``work.wait()``: nothing to keep."""

    def release(self, permanent_too: bool = False) -> None:
        """The parameters changed: drop anything kept from earlier gathers."""

    def held_bytes(self) -> int:
        return 0


class QwZGather(ExactGather):
    """ZeRO++ qwZ: quantize the 16-bit shard to INT8 blocks before the all-gather."""

    def launch(self, out: torch.Tensor, tier: Tier, async_op: bool):
        local = quantize_shard(tier.fetch(), self.settings.weight_bits, self.settings.block_size)
        return QuantizedGather(self.comm, out, local, self.group, async_op)


class HpZGather:
    """ZeRO++ hpZ around another codec: the first gather after a change goes through ``inner``
    and keeps this rank's ``1/hpz`` slice of the result (the *secondary shard*); later gathers -
    backward's above all - all-gather the secondaries inside the (intra-node) hpZ group.

    With qwZ the secondary is the slice of the gathered INT8 rows, not of the dequantized
    weights: a quarter of the memory and of the intra-node bytes (fp32), and backward computes
    with the same values. A MixZ++ group (``permanent``) keeps its secondary for the whole run:
    frozen weights never change.
    """

    def __init__(self, inner: ExactGather, hpz: Group, rank: int, permanent: bool) -> None:
        self.inner, self.hpz, self.permanent = inner, hpz, permanent
        self.index = hpz.rank_of(rank)
        self.secondary: torch.Tensor | Quantized | None = None
        self._keep = False

    def launch(self, out: torch.Tensor, tier: Tier, async_op: bool):
        comm = self.inner.comm
        self._keep = self.secondary is None
        if isinstance(self.secondary, Quantized):
            return QuantizedGather(comm, out, self.secondary, self.hpz, async_op)
        if self.secondary is not None:
            return comm.all_gather(out, self.secondary, self.hpz, async_op=async_op)
        return self.inner.launch(out, tier, async_op)

    def finish(self, out: torch.Tensor, work) -> None:
        """Keep the values this gather produced, so backward gathers the same ones."""
        if not self._keep:
            return
        self._keep = False
        if isinstance(work, QuantizedGather):
            # Keep the INT8 rows (a quarter of fp32's bytes, half of bf16's): backward
            # dequantizes them to exactly the weights forward computed with.
            q = work.gathered
            rows = q.data.shape[0] // self.hpz.size
            keep = slice(self.index * rows, (self.index + 1) * rows)
            self.secondary = Quantized(
                q.data[keep].clone(), q.scales[keep].clone(), q.numel, q.bits, q.block_size,
                q.format,
            )  # fmt: skip
        else:
            size = out.numel() // self.hpz.size
            self.secondary = out[self.index * size : (self.index + 1) * size].clone()

    def release(self, permanent_too: bool = False) -> None:
        if permanent_too or not self.permanent:
            self.secondary = None

    def held_bytes(self) -> int:
        s = self.secondary
        if isinstance(s, Quantized):
            return s.nbytes
        return 0 if s is None else s.numel() * s.element_size()

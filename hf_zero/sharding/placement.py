"""Where a group's parameter values live between steps, and how updated values reach them.

=====================  ===========================================  ===========================
placement              between steps                                after the step
=====================  ===========================================  ===========================
`WholeParams`          the whole ``flat_param`` on every rank       copied in (stage 0)
`ReplicatedParams`     the whole ``flat_param``; this rank updates  this rank's region is
                       its region                                   all-gathered (stages 1-2)
`ShardedParams`        only this rank's shard, in its tier (device,  written into the tier; the
                       host, swap file, INT8)                        next forward gathers it
                                                                     (stage 3)
=====================  ===========================================  ===========================

Under ZeRO-Offload the step sends each finished tile as it goes (`receive_tile`): into a device
buffer that is all-gathered at the end (stages 1-2), or straight into the tier (stage 3).
"""

from __future__ import annotations

import torch

from hf_zero.comm import Collectives
from hf_zero.comm.topology import Group
from hf_zero.sharding.tiers import Tier
from hf_zero.storage.swap import SwapFile, SwapSpace


class Placement:
    """The base: what a group asks of its parameters' side."""

    def master_view(self) -> tuple[torch.Tensor, bool] | None:
        """Without offload: (this rank's part of the values, which an fp32 or 16-bit master may
        be itself; whether stepping it updates every parameter), or None where it cannot be."""
        return None

    def receive_tile(self, start: int, tile: torch.Tensor) -> None:
        """Offload: start copying updated elements ``[start, start + len)`` of this rank's
        shard."""
        raise NotImplementedError

    def publish(self, updated: torch.Tensor | None, async_op: bool):
        """Bring the parameters up to date with ``updated`` (this rank's shard), or with the
        tiles received (``updated`` None). Returns a collective's work handle, or None."""
        raise NotImplementedError

    def write_shard(self, values: torch.Tensor) -> None:
        """Replace this rank's stored shard (stage 3; the others hold ``flat_param`` itself)."""

    def master_file(self, space: SwapSpace, dtype: torch.dtype) -> SwapFile | None:
        """A swap file in ``space`` that already holds this rank's shard in ``dtype``, for a
        master of that dtype in swap files to keep its values in (one file, not two), or None."""
        return None

    def staged_bytes(self) -> int:
        return 0

    def release_staged(self) -> None:
        """Free the tiles' device buffer once the parameters have them."""


class WholeParams(Placement):
    """Stage 0: every rank keeps and updates the whole buffer."""

    def __init__(self, flat_param: torch.Tensor) -> None:
        self.flat_param = flat_param

    def master_view(self) -> tuple[torch.Tensor, bool]:
        return self.flat_param, True

    def publish(self, updated: torch.Tensor | None, async_op: bool):
        self.flat_param.copy_(updated)


class ReplicatedParams(Placement):
    """Stages 1-2: the whole buffer on every rank, this rank's region updated by its step and
    the others all-gathered in place."""

    def __init__(
        self,
        flat_param: torch.Tensor,
        shard: tuple[int, int],
        comm: Collectives,
        group: Group,
    ) -> None:
        self.flat_param, self.shard, self.comm, self.group = flat_param, shard, comm, group
        self._staged: torch.Tensor | None = None  # offload: the updated shard on its way

    def master_view(self) -> tuple[torch.Tensor, bool]:
        start, end = self.shard
        return self.flat_param[start:end], False

    def receive_tile(self, start: int, tile: torch.Tensor) -> None:
        if self._staged is None:
            numel = self.shard[1] - self.shard[0]
            flat = self.flat_param
            self._staged = torch.empty(numel, dtype=flat.dtype, device=flat.device)
        self._staged[start : start + tile.numel()].copy_(tile, non_blocking=True)

    def publish(self, updated: torch.Tensor | None, async_op: bool):
        # fp32: `updated` is flat_param's own region, gathered in place.
        shard = self._staged if updated is None else updated.to(self.flat_param.dtype)
        return self.comm.all_gather(self.flat_param, shard, self.group, async_op=async_op)

    def staged_bytes(self) -> int:
        staged = self._staged
        return 0 if staged is None else staged.numel() * staged.element_size()

    def release_staged(self) -> None:
        self._staged = None


class ShardedParams(Placement):
    """Stage 3: only this rank's shard persists, in ``tier``."""

    def __init__(self, tier: Tier, dtype: torch.dtype) -> None:
        self.tier, self.dtype = tier, dtype

    def master_view(self) -> tuple[torch.Tensor, bool] | None:
        return (self.tier.data, True) if self.tier.in_device_memory else None

    def receive_tile(self, start: int, tile: torch.Tensor) -> None:
        self.tier.take_step_tile(tile.to(self.dtype), start)

    def master_file(self, space: SwapSpace, dtype: torch.dtype) -> SwapFile | None:
        return self.tier.share_with_master(space, dtype)

    def publish(self, updated: torch.Tensor | None, async_op: bool):
        if updated is None:
            self.tier.flush()  # the tiles were written into the tier itself
        else:
            self.tier.write_(updated)  # the next forward gathers it

    def write_shard(self, values: torch.Tensor) -> None:
        self.tier.write_(values)

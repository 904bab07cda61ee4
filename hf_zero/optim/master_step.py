"""How the user's optimizer steps the master shards: one kind per place the masters live.

==============  ======================================================  =======================
kind            the step                                                chosen when the masters
==============  ======================================================  =======================
`DeviceStep`    the optimizer's own ``step()``, one bucket at a time     are on the device
`HostStep`      on the host, tile by tile (torch's fused CPU Adam or     are in host memory
                `CPUAdam`), each tile copied back as the next is         (ZeRO-Offload)
                updated
`StreamedStep`  tiles streamed from swap files through a ring of         are in swap files
                buffers, reads and writes overlapped with the update     (ZeRO-Infinity)
`SplitStep`     `DeviceStep` (or `StreamedStep`) over those buckets,     some on the device (or in
                then `HostStep` over the host ones (a GPU runs the       swap files), the rest in
                first while the CPU steps the second)                    host memory
==============  ======================================================  =======================

`ShardedOptimizer` picks one at construction (`master_step`, from `MasterWeights.location`) and
calls it; what differs by offload mode lives here, not in a branch of its step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from hf_zero.optim.cpu_adam import DEFAULT_TILE, CPUAdam, adam_step, supports_fast_step
from hf_zero.optim.streamed_step import streamed_step
from hf_zero.sharding.flat_group import FlatParamGroup
from hf_zero.sharding.master import HostCompactMaster


class MasterStep:
    """Step ``optimizer`` (its ``param_groups`` already point at the groups' masters)."""

    offload = True
    """The masters, their gradients and the step are off the device (host or swap files)."""
    fast_kernel = False
    """The user's Adam/AdamW is stepped by torch's fused CPU kernel instead of its own."""

    def __init__(self, optimizer: torch.optim.Optimizer, groups: list[FlatParamGroup]) -> None:
        self.optimizer, self.groups = optimizer, groups

    def __call__(self) -> None:
        raise NotImplementedError


class DeviceStep(MasterStep):
    """One bucket at a time. 16-bit gradients: one bucket's is converted to fp32, stepped and
    freed before the next, so at most one bucket's fp32 gradient exists (DeepSpeed's stage 1-2
    steps one param group at a time for the same reason). Any precision: an optimizer's
    temporaries (foreach AdamW makes one the size of everything it steps) are one bucket's, not
    the whole shard's. The optimizer's ``step()`` (and its hooks) runs once per bucket, with
    ``param_groups`` narrowed to that bucket's master; elementwise optimizers compute exactly
    what one call over all buckets would. A master kept in 16 bits (or with 16-bit optimizer
    state) is stepped in fp32 on a one-bucket copy (`MasterWeights.stepped`)."""

    offload = False

    def __call__(self) -> None:
        optimizer, param_groups = self.optimizer, self.optimizer.param_groups
        members = [group["params"] for group in param_groups]
        try:
            for g in self.groups:
                if not g.grads.materialize():
                    continue  # no gradient anywhere: skipped, as torch skips grad None
                param_group = param_groups[g.param_group_index]
                with g.master_weights.stepped(optimizer) as param:  # fp32, for 16-bit storage
                    param_group["params"] = [param]
                    optimizer.param_groups = [param_group]
                    optimizer.step()
                g.grads.release()
        finally:
            optimizer.param_groups = param_groups
            for group, params in zip(param_groups, members):
                group["params"] = params


class HostStep(MasterStep):
    """ZeRO-Offload: Adam/AdamW tile by tile on the host (`CPUAdam`, or torch's fused CPU kernel
    for the user's own when ``fast_kernel``), each finished tile's copy to the device started
    while the next is updated; any other elementwise optimizer steps untiled, its shard copied
    after."""

    def __init__(self, optimizer, groups, fast_kernel: bool) -> None:
        super().__init__(optimizer, groups)
        self.fast_kernel = _fast_kernel(optimizer, fast_kernel)
        self.state_dtype = groups[0].master_weights.kept_dtype(optimizer) if groups else None
        """Adam's moments between steps: ``optimizer_states_dtype``, else `CPUAdam`'s own."""
        self.overlap_copy_back = True
        """Copy each updated tile while the CPU updates the next (False: every shard after the
        whole step; benchmarks/bench_gpu_offload.py times both)."""
        self._group_of_master = {id(g.master): g for g in groups}

    def _copy_back(self, master: torch.Tensor, start: int, end: int) -> None:
        self._group_of_master[id(master)].send_tile(start, end)

    def __call__(self) -> None:
        on_tile = self._copy_back if self.overlap_copy_back else None
        optimizer = self.optimizer
        with _narrowed(optimizer, self.groups):
            if _tiled(optimizer, self.fast_kernel):
                tile = getattr(optimizer, "tile_numel", DEFAULT_TILE)
                adam_step(optimizer, tile, self.state_dtype, on_tile)  # widens bf16 state by tile
            else:
                optimizer.step()  # any other elementwise optimizer, untiled


class BucketHostStep(DeviceStep):
    """ZeRO-Offload stepped one bucket at a time, as on the device, where the host keeps bf16
    (`MasterWeights.stepped`): bf16 masters (`HostCompactMaster`), or bf16 state for an
    optimizer the tiled kernel does not run. Each bucket is stepped in fp32 on a one-bucket
    copy and rounded back; the updated shard is then copied to the device whole."""

    offload = True
    overlap_copy_back = False  # no tiles: each shard is sent after its bucket's step


class SplitStep(MasterStep):
    """Masters in two places, each part stepped by its own kind, ``first`` before ``host``.
    Partial offload (``offload_optimizer_ratio``): the device buckets' step is issued first; on
    a GPU its kernels run while the CPU steps the host buckets. ZeRO-Infinity with a host cache
    (``offload_optimizer_max_in_cpu``): the buckets in swap files stream, then the cached ones
    step in memory."""

    def __init__(self, first: DeviceStep | StreamedStep, host: HostStep | BucketHostStep) -> None:
        super().__init__(host.optimizer, first.groups + host.groups)
        self.first, self.host = first, host
        self.fast_kernel = host.fast_kernel

    @property
    def overlap_copy_back(self) -> bool:
        return self.host.overlap_copy_back

    @overlap_copy_back.setter
    def overlap_copy_back(self, on: bool) -> None:
        self.host.overlap_copy_back = on

    def __call__(self) -> None:
        self.first()
        self.host()


@contextmanager
def _narrowed(optimizer: torch.optim.Optimizer, groups: list[FlatParamGroup]) -> Iterator[None]:
    """``optimizer.param_groups`` hold only ``groups``' masters for the duration."""
    masters = {id(g.master) for g in groups}
    members = [group["params"] for group in optimizer.param_groups]
    for group, params in zip(optimizer.param_groups, members):
        group["params"] = [p for p in params if id(p) in masters]
    try:
        yield
    finally:
        for group, params in zip(optimizer.param_groups, members):
            group["params"] = params


class StreamedStep(MasterStep):
    """ZeRO-Infinity: master, gradient and state read from swap files a tile at a time through
    ``buffer_count`` buffer sets, each updated tile sent to the parameters and written back
    (`streamed_step`)."""

    def __init__(self, optimizer, groups, fast_kernel: bool, buffer_count: int) -> None:
        super().__init__(optimizer, groups)
        self.fast_kernel = _fast_kernel(optimizer, fast_kernel)
        self.buffer_count = buffer_count

    def __call__(self) -> None:
        def write_back(group: FlatParamGroup, start: int, end: int, values) -> None:
            group.send_tile(start, end, values)

        streamed_step(
            self.optimizer, self.groups, self.fast_kernel, write_back,
            buffer_count=self.buffer_count,
        )  # fmt: skip


def _tiled(optimizer: torch.optim.Optimizer, fast_kernel: bool) -> bool:
    """Whether an offloaded step runs `adam_step` over tiles (`CPUAdam`, or the fast kernel)."""
    return isinstance(optimizer, CPUAdam) or fast_kernel


def _host_step(
    optimizer: torch.optim.Optimizer, groups: list[FlatParamGroup], fast_kernel: bool
) -> HostStep | BucketHostStep:
    """The step for masters in host memory: tiled in place, unless they are kept in bf16
    where the tiles cannot widen them (see `BucketHostStep`)."""
    master = groups[0].master_weights
    untiled_16bit = master.state_dtype is not None and not _tiled(
        optimizer, _fast_kernel(optimizer, fast_kernel)
    )
    if isinstance(master, HostCompactMaster) or untiled_16bit:
        return BucketHostStep(optimizer, groups)
    return HostStep(optimizer, groups, fast_kernel)


def _fast_kernel(optimizer: torch.optim.Optimizer, wanted: bool) -> bool:
    """Whether an offloaded step runs torch's fused CPU Adam kernel for the user's optimizer
    (`CPUAdam` tiles its own)."""
    return wanted and supports_fast_step(optimizer) and not isinstance(optimizer, CPUAdam)


def master_step(
    optimizer: torch.optim.Optimizer,
    groups: list[FlatParamGroup],
    fast_kernel: bool,
    buffer_count: int,
) -> MasterStep:
    """The step for where ``groups``' masters live (`MasterWeights.location`); ``fast_kernel``
    and ``buffer_count`` are the config's ``offload_optimizer_fast_kernel`` and
    ``offload_optimizer_buffer_count``."""
    at: dict[str, list[FlatParamGroup]] = {}
    for g in groups:
        if g.master_weights is not None:
            at.setdefault(g.master_weights.location, []).append(g)
    kinds = {
        "device": lambda part: DeviceStep(optimizer, part),
        "host": lambda part: _host_step(optimizer, part, fast_kernel),
        "nvme": lambda part: StreamedStep(optimizer, part, fast_kernel, buffer_count),
    }
    if len(at) == 2 and "host" in at:
        (other,) = set(at) - {"host"}
        return SplitStep(kinds[other](at[other]), kinds["host"](at["host"]))
    if len(at) > 1:
        raise NotImplementedError(f"hf_zero: master weights in {sorted(at)} at once")
    (location,) = at or {"device"}
    return kinds[location](groups)

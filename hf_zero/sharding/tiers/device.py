"""The shard in device memory (plain ZeRO-3) or in host memory (``offload_param: cpu``)."""

from __future__ import annotations

import torch

from hf_zero.numerics.quant import Quantized
from hf_zero.observe import clock


class Tier:
    """What every tier offers its group. ``context`` carries what a tier may need beyond the
    values (the NVMe swap space, quantization settings); unused by the in-memory tiers."""

    kind = "params"  # `memory_report()` kind of the bytes held
    keeps_full = False  # True: the full parameters are never released (stages 0-2)
    permanent = False  # True: the shard never changes (MixZ++), gathers may keep copies of it
    in_device_memory = False  # True: ``data`` is the shard on the device (fp32 masters alias it)

    def __init__(self, values: torch.Tensor, device: torch.device, context=None) -> None:
        raise NotImplementedError

    def fetch(self) -> torch.Tensor | Quantized:
        """The shard, on the device, for one gather (the gather holds it until it is done)."""
        raise NotImplementedError

    def prefetch(self) -> None:
        """Start bringing the shard closer (read-ahead); a no-op where it is already close."""

    def write_(self, values: torch.Tensor, start: int = 0, non_blocking: bool = False) -> None:
        """Copy ``values`` into elements ``[start, start + len)`` of the shard."""
        raise NotImplementedError

    def take_step_tile(self, values: torch.Tensor, start: int) -> None:
        """The optimizer step updated elements ``[start, start + len)``: copy them in (the NVMe
        tier skips its disk write when the step's master file is its file)."""
        self.write_(values, start, non_blocking=True)

    def share_with_master(self, space, dtype: torch.dtype) -> object | None:
        """The swap file holding this shard when a master of ``dtype`` in swap space ``space``
        may keep its values there too (the same numbers: then the step's tiles are written
        once, by the master), or None: only `NvmeTier` has one."""
        return None

    def flush(self) -> None:
        """Wait for writes started with ``non_blocking=True`` (device copies are stream-ordered,
        so only the NVMe tier has any)."""

    def held_bytes(self) -> dict[str, int]:
        raise NotImplementedError


class ResidentTier(Tier):
    """Stages 0-2: no shard is stored apart, the group holds its full parameters all the time;
    gathers, releases and read-ahead have nothing to do."""

    keeps_full = True

    def __init__(self, values: torch.Tensor | None = None, device=None, context=None) -> None:
        pass

    def fetch(self) -> torch.Tensor:
        raise RuntimeError("hf_zero: stages 0-2 hold the full parameters: nothing to gather")

    def held_bytes(self) -> dict[str, int]:
        return {}  # the group's ``flat_param`` is counted as its parameters


class DeviceTier(Tier):
    """The shard in device memory (plain ZeRO-3): gathers read it in place."""

    in_device_memory = True

    def __init__(self, values: torch.Tensor, device: torch.device, context=None) -> None:
        self.data = values.to(device, copy=True)

    def fetch(self) -> torch.Tensor:
        return self.data

    def write_(self, values: torch.Tensor, start: int = 0, non_blocking: bool = False) -> None:
        self.data[start : start + values.numel()].copy_(values, non_blocking=non_blocking)

    def held_bytes(self) -> dict[str, int]:
        return {self.kind: self.data.numel() * self.data.element_size()}


class HostTier(DeviceTier):
    """The shard in host memory (``offload_param: cpu``); a gather copies it to the device.

    On a CPU-only machine host and device are the same memory, and the same copies run, so the
    path is exercised (and exact) in every test.
    """

    kind = "host_params"
    in_device_memory = False

    def __init__(self, values: torch.Tensor, device: torch.device, context=None) -> None:
        self.device = device
        pin = device.type == "cuda"
        self.data = torch.empty(values.numel(), dtype=values.dtype, pin_memory=pin)
        self.data.copy_(values)

    def fetch(self) -> torch.Tensor:
        with clock.phase("copy"):
            local = torch.empty(self.data.shape, dtype=self.data.dtype, device=self.device)
            return local.copy_(self.data, non_blocking=True)

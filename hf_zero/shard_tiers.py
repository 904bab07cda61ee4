"""Where a stage-3 group's 16-bit parameter shard lives between gathers: its storage tier.

Plain ZeRO-3 keeps every rank's shard of every unit in device memory (`DeviceTier`). With
``offload_param: cpu`` (ZeRO-Infinity's CPU tier) it lives in host memory (`HostTier`, pinned
when a GPU is present), so the device holds only the units being gathered: each gather first
copies the shard to the device, and the updated values go back to the host after the step.

A tier is deliberately small: the group asks it for the shard on the device for one gather
(`fetch`), writes updated values into it (`write_`), and reads its bytes (`held_bytes`). Adding a
tier (NVMe is next: issue 18) is one class here and one entry in `TIERS`.
"""

from __future__ import annotations

import torch


class DeviceTier:
    """The shard in device memory (plain ZeRO-3): gathers read it in place."""

    kind = "params"  # `memory_report()` kind

    def __init__(self, values: torch.Tensor, device: torch.device) -> None:
        self.data = values.to(device, copy=True)

    def fetch(self) -> torch.Tensor:
        return self.data

    def write_(self, values: torch.Tensor, start: int = 0, non_blocking: bool = False) -> None:
        """Copy ``values`` into elements ``[start, start + len)`` of the shard."""
        self.data[start : start + values.numel()].copy_(values, non_blocking=non_blocking)

    def held_bytes(self) -> dict[str, int]:
        return {self.kind: self.data.numel() * self.data.element_size()}


class HostTier(DeviceTier):
    """The shard in host memory (``offload_param: cpu``); a gather copies it to the device.

    On a CPU-only machine host and device are the same memory, and the same copies run, so the
    path is exercised (and exact) in every test.
    """

    kind = "host_params"

    def __init__(self, values: torch.Tensor, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.device = device
        self.data = torch.empty(values.numel(), dtype=values.dtype, pin_memory=pin)
        self.data.copy_(values)

    def fetch(self) -> torch.Tensor:
        """A device copy of the shard for one gather; the gather holds it until it is done."""
        local = torch.empty(self.data.shape, dtype=self.data.dtype, device=self.device)
        return local.copy_(self.data, non_blocking=True)


TIERS = {"none": DeviceTier, "cpu": HostTier}
"""``offload_param`` value -> tier class."""

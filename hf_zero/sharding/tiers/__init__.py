"""Storage tiers: where a stage-3 group's parameter shard lives between gathers.

A tier answers one question for `FlatParamGroup`: where are this rank's shard bytes? The group
asks it for the shard on the device for one gather (`fetch`), may ask it to start reading ahead
(`prefetch`), writes updated values back (`write_`) and reads what it holds (`held_bytes`).

=============  ==============================  ==================================================
tier           ``offload_param``               the shard lives
=============  ==============================  ==================================================
`ResidentTier` stages 0-2                      nowhere apart: the full parameters stay held
`DeviceTier`   ``none`` (plain ZeRO-3)         in device memory; gathers read it in place
`HostTier`     ``cpu``                         in host memory (pinned on CUDA), copied per gather
`NvmeTier`     ``nvme``                        in a swap file, read ahead in the traced order
                                              (the first up to ``offload_param_max_in_cpu``
                                              elements also cached in host memory)
`QuantizedTier` MixZ++ frozen groups           as INT8 blocks (`Quantized`), for the whole run
=============  ==============================  ==================================================

Adding a tier is one module here and one entry in `PARAM_TIERS`.
"""

from __future__ import annotations

from hf_zero.sharding.tiers.device import DeviceTier, HostTier, ResidentTier, Tier
from hf_zero.sharding.tiers.nvme import NvmeParams, NvmeTier
from hf_zero.sharding.tiers.quantized import QuantizedTier

PARAM_TIERS: dict[str, type[Tier]] = {"none": DeviceTier, "cpu": HostTier, "nvme": NvmeTier}
"""``offload_param.device`` -> tier class."""

__all__ = [
    "PARAM_TIERS",
    "DeviceTier",
    "HostTier",
    "NvmeParams",
    "NvmeTier",
    "QuantizedTier",
    "ResidentTier",
    "Tier",
]

"""How a flat group is built and where its parts live, decided once by `GroupBuilder`.

`FlatParamGroup` takes its parameters and one `GroupSpec`; every choice of mode (stage, dtypes,
ZeRO++ codecs, parameter tier, where the master weights and optimizer state live, 16-bit
storage) is a field here, so the group never rebuilds a mode from flags.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hf_zero.comm import ZeroPPSettings
from hf_zero.storage.buffer_pool import NoPool

if TYPE_CHECKING:
    from hf_zero.comm import Collectives
    from hf_zero.comm.topology import Group
    from hf_zero.sharding.tiers.nvme import NvmeParams
    from hf_zero.storage.swap import SwapSpace


@dataclass(frozen=True)
class GroupSpec:
    """One group's mode: what `FlatParamGroup` and the parts it picks are built from."""

    stage: int
    dtype: torch.dtype
    """The parameters' (and full buffer's) dtype; a packed group holds their bytes instead."""
    reduce_dtype: torch.dtype
    """What gradients are reduced in (``communication_data_type``)."""
    shard_group: Group
    rank: int
    """This process's global rank."""
    comm: Collectives
    zeropp: ZeroPPSettings = field(default_factory=ZeroPPSettings)
    offload_optimizer: str = "none"
    """Where the master weights, their gradient and the optimizer state live: ``"none"`` (the
    device), ``"cpu"`` (host memory) or ``"nvme"`` (``optimizer_swap``'s files)."""
    optimizer_swap: SwapSpace | None = None
    param_tier: str = "none"
    """Stage 3: where the parameter shard lives (`hf_zero.sharding.tiers.PARAM_TIERS`)."""
    param_swap: NvmeParams | None = None
    """``param_tier: nvme``: the swap space and host budget its tiers share."""
    compact_master: bool = False
    """The 16-bit parameters are the master (`hf_zero.sharding.master.CompactMaster`)."""
    state_dtype: torch.dtype | None = None
    """Elementwise optimizer state kept in this dtype (None: the optimizer's own)."""
    pool: NoPool = field(default_factory=NoPool)
    """Stage 3: where gathers take their full buffer and releases give it back
    (`hf_zero.storage.buffer_pool`)."""

    def __post_init__(self) -> None:
        if (self.offload_optimizer == "nvme") != (self.optimizer_swap is not None):
            raise ValueError("GroupSpec: offload_optimizer 'nvme' needs an optimizer_swap, only it")

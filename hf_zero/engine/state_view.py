"""What save, load and export code may read of an engine, and nothing more.

`checkpointing`, `full_state_dict`, `pretrained_save` and `save_failure` take an `EngineState`:
the model, the flat groups, the sharded optimizer, the topology and the counters a checkpoint
records. `ZeroEngine` is one (structurally: nothing here imports it), so those modules sit below
the engine instead of beside it, and ``tests/test_layers.py`` checks that every ``engine.<name>``
they read is declared here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from hf_zero.comm.collectives import Collectives
    from hf_zero.comm.topology import Topology
    from hf_zero.config.zero_config import ZeroConfig
    from hf_zero.numerics.precision import LossScaler
    from hf_zero.optim.sharded import ShardedOptimizer
    from hf_zero.sharding.flat_group import FlatParamGroup
    from hf_zero.sharding.tp import TensorParallel


class EngineState(Protocol):
    """An engine as the save, load and export code sees it."""

    module: torch.nn.Module
    config: ZeroConfig
    topology: Topology
    comm: Collectives
    tp: TensorParallel | None
    dtype: torch.dtype
    groups: list[FlatParamGroup]
    """Trainable flat groups (each with its master weights)."""
    frozen_groups: list[FlatParamGroup]
    """Stage 3: the sharded frozen parameters (no master, no optimizer state)."""
    optimizer: ShardedOptimizer
    loss_scaler: LossScaler
    loaded_dtypes: dict[str, torch.dtype]
    """Each parameter's dtype as the model was handed over (``save_pretrained`` keeps it)."""
    global_steps: int
    skipped_steps: int
    checkpoint_run_id: str
    """This run's id in its checkpoints (set at the first save, or taken from a loaded one)."""

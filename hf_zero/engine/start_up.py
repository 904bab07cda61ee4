"""What both engines do first: join the default process group, create the run's groups, its
collectives and its stall watchdog, and resolve the config's "auto" values from the model and the
data-parallel size."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hf_zero.comm import Collectives
from hf_zero.comm.topology import Topology, current_device, hpz_size, init_distributed
from hf_zero.comm.watchdog import StallWatchdog
from hf_zero.config.zero_config import ZeroConfig
from hf_zero.engine.process_exit import collect_once_at_exit


@dataclass(frozen=True)
class StartUp:
    """An engine's connection to the run."""

    config: ZeroConfig
    """The config with "auto" resolved; read-only."""
    topology: Topology
    comm: Collectives
    device: torch.device
    watchdog: StallWatchdog


def start_up(config: ZeroConfig, module: torch.nn.Module, steps: Callable[[], object]) -> StartUp:
    """Create the process groups of ``config``'s layout (collective: every rank calls it), the
    collectives and the stall watchdog (``steps()`` says which step a stalled rank is in), then
    resolve ``config`` from ``module``'s hidden size and the data-parallel size. The process's
    exit is made quick (`process_exit`)."""
    init_distributed(timeout=config.comm_timeout)
    collect_once_at_exit()
    hpz = hpz_size(config.hpz_partition_size, config.tp_size, config.node_size)
    topology = Topology.build(
        config.tp_size, config.node_size, hpz, config.comm_timeout, config.sp_size, config.pp_size
    )
    comm = Collectives(native_collectives=config.native_collectives)
    watchdog = StallWatchdog.start(
        config.stall_warning_seconds, topology.rank, topology.world_size, steps,
        timeout=config.comm_timeout,
    )  # fmt: skip
    hidden = getattr(getattr(module, "config", None), "hidden_size", None)
    resolved = config.resolved(hidden_size=hidden, world_size=topology.data_size)
    resolved.check_batch_sizes(topology.data_size)
    return StartUp(resolved, topology, comm, current_device(), watchdog)

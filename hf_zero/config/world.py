"""Checks that need the number of processes: what `initialize` would refuse for a world size,
raised before any model exists."""

from __future__ import annotations

from hf_zero.config.checks import AUTO


def check_batch_sizes(config, world_size: int) -> None:
    """Raise if train_batch_size != micro_batch * gradient_accumulation_steps * dp world."""
    tb, mb, gas = (
        config.train_batch_size,
        config.train_micro_batch_size_per_gpu,
        config.gradient_accumulation_steps,
    )
    all_known = all(isinstance(v, int) for v in (tb, mb, gas))
    if all_known and tb != mb * gas * world_size:
        raise ValueError(
            f"zero config: 'train_batch_size' = {tb} must equal "
            f"train_micro_batch_size_per_gpu ({mb}) x gradient_accumulation_steps ({gas})"
            f" x data-parallel world size ({world_size}) = {mb * gas * world_size}"
        )


def check_world(config, world_size: int) -> None:
    """Raise what `initialize` would refuse for ``world_size`` processes, before any model
    exists: ``tp_size`` and ``hpz_partition_size`` must divide the ranks they split, and
    the batch sizes must agree."""
    if world_size % config.tp_size:
        raise ValueError(
            f"zero config: 'tp_size' = {config.tp_size} must divide the number of processes "
            f"({world_size})"
        )
    if world_size % (config.tp_size * config.pp_size):
        raise ValueError(
            f"zero config: 'pp_size' = {config.pp_size} x 'tp_size' = {config.tp_size} must "
            f"divide the number of processes ({world_size})"
        )
    dp_size = world_size // (config.tp_size * config.pp_size)
    if dp_size % config.sp_size:
        raise ValueError(
            f"zero config: 'sp_size' = {config.sp_size} must divide the number of processes "
            f"({world_size})"
        )
    hpz = config.hpz_partition_size
    if hpz != AUTO and dp_size % hpz:
        raise ValueError(
            f"zero config: 'hpz_partition_size' = {hpz} must divide the data-parallel size "
            f"({dp_size} = {world_size} processes / tp_size {config.tp_size})"
        )
    check_batch_sizes(config, dp_size // config.sp_size)

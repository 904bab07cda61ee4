"""Checks of the offload settings (ZeRO-Offload and ZeRO-Infinity): each error names the key,
the value and what is allowed."""

from __future__ import annotations

from hf_zero.config.checks import AUTO, at_least, one_of


def check_offload_settings(config) -> None:
    """Refuse offload settings that the stage, the tier or each other rule out."""
    if config.offload_param != "none" and config.stage != 3:
        raise ValueError(
            f"zero config: 'offload_param' = {config.offload_param!r} needs 'stage' = 3; "
            f"got stage {config.stage}"
        )
    if config.offload_optimizer != "none" and config.stage == 0:
        raise ValueError(
            f"zero config: 'offload_optimizer' = {config.offload_optimizer!r} needs 'stage' "
            "1, 2 or 3 (stage 0 keeps no sharded optimizer to offload)"
        )
    if config.offload_optimizer == "nvme" and config.stage != 3:
        raise ValueError(
            f"zero config: 'offload_optimizer' = 'nvme' needs 'stage' = 3 (ZeRO-Infinity); "
            f"got stage {config.stage}. Use 'cpu' for stages 1-2"
        )
    for tier in ("offload_param", "offload_optimizer"):
        if getattr(config, tier) == "nvme" and not config.nvme_path_for(tier):
            raise ValueError(
                f"zero config: '{tier}' = 'nvme' needs 'nvme_path' (or "
                f"'{tier}_nvme_path'): a directory on a fast local disk"
            )
    if (
        isinstance(config.offload_optimizer_ratio, bool)
        or not isinstance(config.offload_optimizer_ratio, (int, float))
        or not 0.0 <= config.offload_optimizer_ratio <= 1.0
    ):
        raise ValueError(
            f"zero config: 'offload_optimizer_ratio' = {config.offload_optimizer_ratio!r} must "
            "be a number from 0 to 1 (the fraction of the optimizer kept on the host)"
        )
    if config.offload_optimizer_ratio != 1.0 and config.offload_optimizer != "cpu":
        raise ValueError(
            f"zero config: 'offload_optimizer_ratio' = {config.offload_optimizer_ratio} needs "
            f"'offload_optimizer' = 'cpu' (partial offload); got "
            f"{config.offload_optimizer!r}"
        )
    for name in ("offload_param_buffer_count", "offload_optimizer_buffer_count"):
        at_least(name, getattr(config, name), 1)
    at_least("nvme_io_threads", config.nvme_io_threads, 1)
    if config.offload_optimizer_max_in_cpu and config.offload_optimizer != "nvme":
        raise ValueError(
            f"zero config: 'offload_optimizer_max_in_cpu' = {config.offload_optimizer_max_in_cpu}"
            f" needs 'offload_optimizer' = 'nvme' (it caps what stays in host memory of an "
            f"optimizer in swap files); got {config.offload_optimizer!r}"
        )


def check_storage_dtypes(config) -> None:
    """``master_weights_dtype`` / ``optimizer_states_dtype``: 16-bit storage of what the step
    keeps, wherever it keeps it (the device, host memory, swap files); a bf16 run's only."""
    for key in ("master_weights_dtype", "optimizer_states_dtype"):
        value = getattr(config, key)
        one_of(key, value, ("fp32", "bf16"))
        if value == "fp32":
            continue
        if config.precision not in ("bf16", AUTO):
            raise ValueError(
                f"zero config: '{key}' = 'bf16' needs 'precision' = 'bf16' (16-bit storage of "
                f"a bf16 run's step); got {config.precision!r}"
            )

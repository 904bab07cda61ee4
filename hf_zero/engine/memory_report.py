"""`memory_report()`: the bytes an engine holds now, by kind, counted from its tensors."""

from __future__ import annotations

import torch

from hf_zero.optim import ShardedOptimizer
from hf_zero.sharding.accounting import loose_param_bytes
from hf_zero.sharding.flat_group import FlatParamGroup
from hf_zero.storage.buffer_pool import NoPool

DEVICE_KINDS = ("params", "grads", "master_weights", "optimizer_states")
NVME_KINDS = ("nvme_params", "nvme_grads", "nvme_master_weights", "nvme_optimizer_states")


def held_memory(
    groups: list[FlatParamGroup],
    module: torch.nn.Module,
    grouped: set[int],
    optimizer: ShardedOptimizer,
    pool: NoPool | None = None,
) -> dict[str, int]:
    """What ``groups`` (trainable and frozen), ``module``'s parameters outside them (``grouped``:
    the ids of those inside), ``optimizer``'s state and ``pool`` (gather buffers kept for
    reuse) hold; the kinds and totals that `ZeroEngine.memory_report` documents."""
    report = dict.fromkeys(DEVICE_KINDS, 0)
    report.update(dict.fromkeys(("host_" + k for k in DEVICE_KINDS), 0))
    report.update(secondary_params=0, quantized_params=0)
    report["pooled_params"] = pool.held_bytes() if pool is not None else 0
    report.update(dict.fromkeys(NVME_KINDS, 0))
    for group in groups:
        for kind, nbytes in group.held_bytes().items():
            report[kind] += nbytes
    for kind, nbytes in loose_param_bytes(module, grouped).items():
        report[kind] += nbytes
    report.update(optimizer.state_bytes())
    device = (*DEVICE_KINDS, "secondary_params", "quantized_params", "pooled_params")
    report["total"] = sum(report[k] for k in device)
    report["host_total"] = sum(v for k, v in report.items() if k.startswith("host_"))
    report["nvme_total"] = sum(report[k] for k in NVME_KINDS)
    return report

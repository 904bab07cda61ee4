"""The optimizer and scheduler an engine runs: the user's, or built from the config's DeepSpeed
``optimizer`` / ``scheduler`` sections, as ``deepspeed.initialize`` does."""

from __future__ import annotations

import torch

from hf_zero.config import ZeroConfig
from hf_zero.optim.deepspeed_optimizer import build_optimizer
from hf_zero.optim.deepspeed_schedules import scheduler_from_config
from hf_zero.optim.sharded import check_elementwise
from hf_zero.packed import check_packed


def optimizer_and_scheduler(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, config: ZeroConfig,
    lr_scheduler=None,
) -> tuple[torch.optim.Optimizer, object]:  # fmt: skip
    """``(optimizer, lr_scheduler)``: the ones passed, else the config's; the optimizer must be
    elementwise (what ZeRO's sharded steps need). Checked before any process-group work."""
    if optimizer is None:
        if config.optimizer is None:
            raise ValueError(
                "hf_zero: pass an optimizer, or give the config an 'optimizer' section "
                'such as {"type": "AdamW", "params": {"lr": 1e-4}}'
            )
        optimizer = build_optimizer(
            [p for p in model.parameters() if p.requires_grad], config.optimizer
        )
    check_elementwise(optimizer, config.allow_untested_optimizer)
    check_packed(model, optimizer, config)
    if lr_scheduler is None and config.scheduler is not None:
        lr_scheduler = scheduler_from_config(optimizer, config)
    return optimizer, lr_scheduler

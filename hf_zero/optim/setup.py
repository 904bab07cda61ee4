"""The optimizer and scheduler an engine runs: the user's, or built from the config's DeepSpeed
``optimizer`` / ``scheduler`` sections, as ``deepspeed.initialize`` does."""

from __future__ import annotations

import torch

from hf_zero.config.zero_config import ZeroConfig
from hf_zero.numerics.packed import check_packed
from hf_zero.optim.deepspeed_optimizer import build_optimizer
from hf_zero.optim.deepspeed_schedules import scheduler_from_config
from hf_zero.optim.sharded import check_elementwise


class NoOptimizer:
    """The optimizer of a model with nothing to train (a reference or teacher model sharded for
    evaluation): no parameter groups, no state, and a `step` that says why it cannot."""

    def __init__(self) -> None:
        self.param_groups: list[dict] = []
        self.state: dict = {}
        self.defaults: dict = {}

    def step(self, closure=None):
        raise RuntimeError(
            "hf_zero: this model has no trainable parameters (prepared for evaluation): there "
            "is no optimizer to step"
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def state_dict(self) -> dict:
        return {"state": {}, "param_groups": []}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


def optimizer_and_scheduler(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, config: ZeroConfig,
    lr_scheduler=None,
) -> tuple[torch.optim.Optimizer, object]:  # fmt: skip
    """``(optimizer, lr_scheduler)``: the ones passed, else the config's; the optimizer must be
    elementwise (what ZeRO's sharded steps need). Checked before any process-group work.

    A model without trainable parameters and no optimizer gets a `NoOptimizer`: it is only
    evaluated, and sharded all the same."""
    if optimizer is None and not any(p.requires_grad for p in model.parameters()):
        return NoOptimizer(), None
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

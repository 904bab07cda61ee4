"""DeepSpeed's ``scheduler`` config sections as torch schedulers.

The schedules reproduce ``deepspeed/runtime/lr_schedules.py`` (WarmupLR, WarmupDecayLR,
WarmupCosineLR, OneCycle) step for step, in DeepSpeed's own operation order. They set each group's
learning rate absolutely. DeepSpeed's counter ``last_batch_iteration`` starts at -1 and advances
once per optimizer step, so optimizer step k runs at iteration k - 2 (step 1 at the constructor's
value). Here that counter is ``last_epoch - 1`` of a torch ``LRScheduler`` (whose constructor takes
one step), so the Trainer, Accelerate and checkpoints handle them like any torch scheduler.

``"auto"`` values are filled as in `hf_zero.optim.deepspeed_optimizer` (which builds optimizers).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from hf_zero.optim.deepspeed_optimizer import resolve_params, type_and_params

logger = logging.getLogger(__name__)


def _per_group(optimizer: torch.optim.Optimizer, value: Any, name: str) -> list:
    n = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"zero config: '{name}' has {len(value)} values for {n} param groups")
        return list(value)
    return [value] * n


def _initial_lr(group: dict) -> float:
    # The group's learning rate before any scheduler touched it (torch keeps it as initial_lr).
    return group.get("initial_lr", group["lr"])


class DeepSpeedSchedule(LRScheduler):
    """Base: ``lrs_at(i)`` is DeepSpeed's ``get_lr()`` at ``last_batch_iteration = i``.

    Subclasses list DeepSpeed's keyword arguments and defaults in ``DEFAULTS`` (``REQUIRED``
    ones have none); the constructor takes them as keywords and sets them as attributes.
    """

    DEFAULTS: dict[str, Any] = {}
    REQUIRED: tuple[str, ...] = ()

    def __init__(self, optimizer: torch.optim.Optimizer, **params: Any) -> None:
        name = type(self).__name__
        unknown = sorted(set(params) - set(self.DEFAULTS) - set(self.REQUIRED))
        missing = [k for k in self.REQUIRED if k not in params]
        if unknown or missing:
            allowed = ", ".join([*self.REQUIRED, *self.DEFAULTS])
            raise ValueError(
                f"zero config: scheduler {name}: unknown params {unknown}, missing {missing}; "
                f"allowed: {allowed}"
            )
        self.__dict__.update({**self.DEFAULTS, **params})
        if "warmup_num_steps" in self.DEFAULTS:
            self._check_warmup()
        self.setup(optimizer)
        super().__init__(optimizer)

    def _check_warmup(self) -> None:
        steps = self.warmup_num_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0:
            # DeepSpeed >= 0.19.6 refuses these too.
            raise ValueError(f"zero config: 'warmup_num_steps' = {steps!r} must be a positive int")
        if self.warmup_type not in ("log", "linear"):
            # DeepSpeed falls back to 'log' with a warning; a typo should not change the schedule.
            raise ValueError(
                f"zero config: 'warmup_type' = {self.warmup_type!r}; allowed: log, linear"
            )
        self.warmup_num_steps = max(2, steps)  # DeepSpeed's minimum: log(1) would divide by 0
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)

    def _warmup_gamma(self, i: int) -> float:
        if self.warmup_type == "log":
            return self.inverse_log_warm_up * math.log(i + 1)
        return i / self.warmup_num_steps

    def setup(self, optimizer: torch.optim.Optimizer) -> None:
        """Derived state, before torch's constructor takes its first step."""

    def get_lr(self) -> list[float]:
        return self.lrs_at(self.last_epoch - 1)

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's counter: -1 before the first step, then optimizer steps taken - 1."""
        return self.last_epoch - 1

    def lrs_at(self, iteration: int) -> list[float]:
        raise NotImplementedError


class WarmupLR(DeepSpeedSchedule):
    """``warmup_min_lr`` to ``warmup_max_lr`` over ``max(2, warmup_num_steps)`` steps, then flat;
    'log' warm-up: ``min + (max - min) * log(i + 1) / log(W)``, 'linear': ``i / W``.

    ``warmup_max_lr`` unset: the optimizer's learning rate (current DeepSpeed; older releases
    used 0.001, which WarmupDecayLR still does).
    """

    DEFAULTS = {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000}
    DEFAULTS["warmup_type"] = "log"

    def setup(self, optimizer: torch.optim.Optimizer) -> None:
        top = self.warmup_max_lr
        top = _initial_lr(optimizer.param_groups[0]) if top is None else top
        self.min_lrs = _per_group(optimizer, self.warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, top, "warmup_max_lr")
        self.delta_lrs = [big - small for big, small in zip(self.max_lrs, self.min_lrs)]

    def _gamma(self, i: int) -> float:
        return self._warmup_gamma(i) if i < self.warmup_num_steps else 1.0

    def lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma(iteration)
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at ``total_num_steps``."""

    DEFAULTS = {**WarmupLR.DEFAULTS, "warmup_max_lr": 0.001}
    REQUIRED = ("total_num_steps",)

    def setup(self, optimizer: torch.optim.Optimizer) -> None:
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning("hf_zero: WarmupDecayLR total_num_steps < warmup_num_steps")
        super().setup(optimizer)

    def _gamma(self, i: int) -> float:
        if i < self.warmup_num_steps:
            return self._warmup_gamma(i)
        span = float(max(1.0, self.total_num_steps - self.warmup_num_steps))
        return max(0.0, float(self.total_num_steps - i) / span)


class WarmupCosineLR(DeepSpeedSchedule):
    """Ratios of the optimizer's learning rate: warm-up from ``warmup_min_ratio`` to 1, then a
    cosine to ``cos_min_ratio`` at ``total_num_steps`` (held there after). Before the first
    step the rate is 0, as in DeepSpeed."""

    DEFAULTS = {"warmup_min_ratio": 0.0, "warmup_num_steps": 1000, "cos_min_ratio": 0.0001}
    DEFAULTS["warmup_type"] = "log"
    REQUIRED = ("total_num_steps",)

    def setup(self, optimizer: torch.optim.Optimizer) -> None:
        self.org_lrs = [_initial_lr(group) for group in optimizer.param_groups]

    def ratio_at(self, i: int) -> float:
        if i < self.warmup_num_steps:
            ratio = self._warmup_gamma(i)
            return self.warmup_min_ratio + ratio * (1.0 - self.warmup_min_ratio)
        real_last_step = i - self.warmup_num_steps + 1
        real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, real_last_step / real_total_steps)  # DeepSpeed clamps at the end
        ratio = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * ratio)

    def lrs_at(self, iteration: int) -> list[float]:
        if iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.ratio_at(iteration)
        return [lr * ratio for lr in self.org_lrs]


class OneCycle(DeepSpeedSchedule):
    """DeepSpeed's 1Cycle: ``cycle_min_lr`` up to ``cycle_max_lr`` and back over the two cycle
    halves (optionally in stairs), then ``cycle_min_lr / (1 + decay_lr_rate * i / decay_step_size)``.

    ``cycle_momentum`` (default true) cycles beta1 inversely between ``cycle_max_mom`` and
    ``cycle_min_mom`` and, as DeepSpeed does, sets beta2 to 0.99; optimizers without ``betas``
    (SGD) keep their momentum, with a warning, as in DeepSpeed.
    """

    DEFAULTS = {
        "decay_lr_rate": 0.0,
        "cycle_first_step_size": 2000,
        "cycle_second_step_size": None,
        "cycle_first_stair_count": 0,
        "cycle_second_stair_count": None,
        "decay_step_size": 0,
        "cycle_momentum": True,
        "cycle_min_mom": 0.8,
        "cycle_max_mom": 0.9,
        "decay_mom_rate": 0.0,
    }
    REQUIRED = ("cycle_min_lr", "cycle_max_lr")

    def setup(self, optimizer: torch.optim.Optimizer) -> None:
        first = self.first_step_size = float(self.cycle_first_step_size)
        second = self.cycle_second_step_size
        self.second_step_size = first if second is None else float(second)
        self.total_size = first + self.second_step_size
        self.step_ratio = first / self.total_size
        stairs = self.cycle_second_stair_count
        self.cycle_second_stair_count = self.cycle_first_stair_count if stairs is None else stairs
        no_decay = math.isclose(self.decay_step_size, 0)
        self.skip_lr_decay = no_decay or math.isclose(self.decay_lr_rate, 0)
        self.skip_mom_decay = no_decay or math.isclose(self.decay_mom_rate, 0)
        if self.cycle_momentum and "betas" not in optimizer.param_groups[0]:
            name = type(optimizer).__name__
            logger.warning("hf_zero: OneCycle cycle_momentum is off: %s has no betas", name)
            self.cycle_momentum = False

    def _scale(self, i: int) -> float:
        batch_iteration = i + 1
        cycle = math.floor(1 + batch_iteration / self.total_size)
        x = 1.0 + batch_iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.cycle_first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.cycle_second_stair_count
        if stairs > 0:  # quantised from the integer offset, as DeepSpeed does
            at = batch_iteration % self.total_size
            if at <= self.first_step_size:
                position = at * stairs / self.first_step_size
            else:
                position = (self.total_size - at) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def lrs_at(self, iteration: int) -> list[float]:
        lo, hi = self.cycle_min_lr, self.cycle_max_lr
        if iteration < self.total_size:
            lr = lo + (hi - lo) * self._scale(iteration)
        elif self.skip_lr_decay:
            lr = lo
        else:
            interval = (iteration - self.total_size + 1) / self.decay_step_size
            lr = lo / (1 + self.decay_lr_rate * interval)
        return [lr] * len(self.optimizer.param_groups)

    def beta1_at(self, iteration: int) -> float:
        lo, hi = self.cycle_min_mom, self.cycle_max_mom
        if iteration < 0:
            return lo  # DeepSpeed's constructor starts at cycle_min_mom
        if iteration < self.total_size:
            return hi - (hi - lo) * self._scale(iteration)
        if self.skip_mom_decay:
            return hi
        interval = (iteration - self.total_size + 1) / self.decay_step_size
        return hi * (1 + self.decay_mom_rate * interval)

    def step(self, epoch: int | None = None) -> None:
        super().step(epoch)
        if self.cycle_momentum:
            betas = (self.beta1_at(self.last_epoch - 1), 0.99)
            for group in self.optimizer.param_groups:
                group["betas"] = betas


SCHEDULERS = {c.__name__: c for c in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle)}


def build_scheduler(
    optimizer: torch.optim.Optimizer, section: Mapping, values: Mapping[str, Any] | None = None
) -> DeepSpeedSchedule:
    """The schedule of a DeepSpeed ``scheduler`` section on ``optimizer``; step it once after
    each optimizer step that was not skipped."""
    name, params = type_and_params("scheduler", section, SCHEDULERS)
    cls = SCHEDULERS[name]
    allowed = {*cls.DEFAULTS, *cls.REQUIRED}
    return cls(optimizer, **resolve_params("scheduler", params, allowed, values or {}))


def scheduler_from_config(
    optimizer: torch.optim.Optimizer,
    config: Any,
    total_steps: int | None = None,
    *,
    warmup_steps: int | None = None,
    learning_rate: float | None = None,
) -> DeepSpeedSchedule | None:
    """The ``config.scheduler`` schedule (a `ZeroConfig`) for a custom loop, or None without one.

    ``"auto"`` takes ``total_num_steps`` from ``total_steps`` (optimizer steps),
    ``warmup_num_steps`` from ``warmup_steps``, ``warmup_max_lr`` from ``learning_rate`` (default:
    the optimizer's) and ``warmup_min_lr`` = 0. Under `ZeroAccelerator`, ``prepare`` it: it then
    advances once per optimizer step, as in DeepSpeed.
    """
    if config.scheduler is None:
        return None
    top = _initial_lr(optimizer.param_groups[0]) if learning_rate is None else learning_rate
    warmup = None if warmup_steps is None else max(1, warmup_steps)
    values = {"warmup_min_lr": 0, "warmup_max_lr": top, "warmup_num_steps": warmup}
    return build_scheduler(optimizer, config.scheduler, {**values, "total_num_steps": total_steps})

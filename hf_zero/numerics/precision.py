"""Mixed-precision helpers: dtype names and fp16 loss scaling."""

from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Precision name (the config's ``precision``) -> torch dtype."""


def dtype_of(name: str | None, default: torch.dtype) -> torch.dtype:
    return default if name is None else DTYPES[name]


class LossScaler:
    """Loss scale for fp16 training, with DeepSpeed's dynamic policy.

    On an overflow the step is skipped; after ``hysteresis`` overflows (DeepSpeed's default is
    2) the scale halves, never below ``min_scale``. After ``window`` good steps in a row it
    doubles. With ``consecutive_hysteresis`` (DeepSpeed's ``fp16.consecutive_hysteresis``) every
    good step restores the hysteresis, so only overflows in a row lower the scale; without it,
    the hysteresis is restored when the scale grows. A fixed scale (``dynamic=False``) never
    changes; scale 1.0 is "no scaling".
    """

    def __init__(
        self,
        scale: float = 1.0,
        dynamic: bool = False,
        window: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
        consecutive_hysteresis: bool = False,
    ) -> None:
        self.scale = float(scale)
        self.consecutive_hysteresis = consecutive_hysteresis
        self.dynamic = dynamic
        self.window = window
        self.hysteresis = hysteresis
        self.min_scale = min_scale
        self._good_steps = 0
        self._hysteresis_left = hysteresis

    @classmethod
    def from_config(cls, config) -> LossScaler:
        if config.precision != "fp16":
            return cls()
        if config.loss_scale > 0:
            return cls(scale=config.loss_scale)
        return cls(
            scale=2.0**config.initial_scale_power,
            dynamic=True,
            window=config.loss_scale_window,
            hysteresis=config.hysteresis,
            min_scale=config.min_loss_scale,
            consecutive_hysteresis=config.consecutive_hysteresis,
        )

    @property
    def enabled(self) -> bool:
        return self.dynamic or self.scale != 1.0

    def update(self, overflow: bool) -> None:
        """Advance the policy by one optimizer step (``overflow`` means it was skipped)."""
        if not self.dynamic:
            return
        if overflow:
            self._good_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
                self._hysteresis_left = self.hysteresis
            return
        self._good_steps += 1
        if self.consecutive_hysteresis:
            self._hysteresis_left = self.hysteresis
        if self._good_steps % self.window == 0:
            self.scale *= 2.0
            self._hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "good_steps": self._good_steps,
            "hysteresis_left": self._hysteresis_left,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume the policy's state; a scaler that does not scale (a bf16 or fp32 run) stays
        at 1, whatever run wrote the checkpoint."""
        if not self.enabled:
            return
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
        self._hysteresis_left = int(state["hysteresis_left"])

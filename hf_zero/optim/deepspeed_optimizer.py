"""DeepSpeed ``optimizer`` sections as torch optimizers, and the ``"auto"`` filling shared with
`hf_zero.optim.deepspeed_schedules`.

``"auto"`` is filled from ``values`` with the keys transformers' DeepSpeed integration fills:
``lr``, ``betas``, ``eps``, ``weight_decay`` (optimizer), ``warmup_min_lr``, ``warmup_max_lr``,
``warmup_num_steps``, ``total_num_steps`` (scheduler); `trainer_values` gives the Trainer's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hf_zero.config.checks import AUTO

_ADAM_KEYS = {"lr", "betas", "eps", "weight_decay", "amsgrad", "bias_correction", "adam_w_mode"}
OPTIMIZER_KEYS = {
    "adam": _ADAM_KEYS | {"torch_adam"},
    "adamw": _ADAM_KEYS | {"torch_adam"},
    "sgd": {"lr", "momentum", "dampening", "weight_decay", "nesterov"},
}
# DeepSpeed's FusedAdam defaults; torch's AdamW alone would decay weights by 0.01.
_ADAM_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}


def trainer_values(args: Any, num_training_steps: int | None = None) -> dict[str, Any]:
    """What ``"auto"`` becomes under the Trainer, as in transformers' ``trainer_config_process``
    and ``trainer_config_finalize``."""
    values = {
        "lr": args.learning_rate,
        "betas": [args.adam_beta1, args.adam_beta2],
        "eps": args.adam_epsilon,
        "weight_decay": args.weight_decay,
        "warmup_min_lr": 0,  # not a Trainer argument
        "warmup_max_lr": args.learning_rate,
    }
    if num_training_steps is not None:
        values["total_num_steps"] = num_training_steps
        # Kept positive as transformers does: DeepSpeed >= 0.19.6 refuses 0.
        values["warmup_num_steps"] = max(1, args.get_warmup_steps(num_training_steps))
    return values


def type_and_params(where: str, section: Any, allowed: Mapping) -> tuple[str, dict]:
    if not isinstance(section, Mapping):
        raise ValueError(f"zero config: '{where}' = {section!r} must be a mapping with 'type'")
    extra = sorted(set(section) - {"type", "params"})
    if extra:
        raise ValueError(
            f"zero config: '{where}' has unknown key(s) {extra}; allowed: type, params"
        )
    name, params = section.get("type"), section.get("params") or {}
    # DeepSpeed lowercases its own optimizer names (SGD is torch's class name, accepted in any
    # case here) and matches scheduler names exactly.
    key = str(name).lower() if where == "optimizer" else str(name)
    if key not in allowed:
        raise ValueError(
            f"zero config: '{where}.type' = {name!r} is not supported; allowed: "
            + ", ".join(allowed if where == "scheduler" else ("Adam", "AdamW", "SGD"))
        )
    if not isinstance(params, Mapping):
        raise ValueError(f"zero config: '{where}.params' = {params!r} must be a mapping")
    return key, dict(params)


def resolve_params(where: str, params: dict, allowed: set, values: Mapping[str, Any]) -> dict:
    """``params`` with ``"auto"`` filled from ``values``; unknown keys raise."""
    unknown = sorted(set(params) - allowed)
    if unknown:
        hint = " (DeepSpeed: use 'gradient_clipping')" if "max_grad_norm" in unknown else ""
        raise ValueError(
            f"zero config: '{where}.params' has unknown key(s) {unknown}{hint}; "
            f"allowed: {', '.join(sorted(allowed))}"
        )
    out = {}
    for key, value in params.items():
        if isinstance(value, str) and value == AUTO:
            if values.get(key) is None:
                raise ValueError(
                    f"zero config: '{where}.params.{key}' = 'auto', but there is nothing to fill "
                    "it from here; give a value (the Trainer fills lr, betas, eps, weight_decay, "
                    "warmup_min_lr, warmup_max_lr, warmup_num_steps, total_num_steps)"
                )
            value = values[key]
        out[key] = value
    return out


def optimizer_spec(
    section: Mapping, values: Mapping[str, Any] | None = None
) -> tuple[type[torch.optim.Optimizer], dict]:
    """The torch class and keyword arguments for a DeepSpeed ``optimizer`` section.

    ``Adam`` runs as AdamW (decoupled weight decay) unless ``adam_w_mode`` is false, as in
    DeepSpeed, whose ``adam_w_mode`` defaults to true; ``AdamW`` is always AdamW. ``torch_adam``
    is accepted and has no effect (hf_zero always runs torch's update rule).
    """
    kind, params = type_and_params("optimizer", section, OPTIMIZER_KEYS)
    kwargs = resolve_params("optimizer", params, OPTIMIZER_KEYS[kind], values or {})
    if kind == "sgd":
        return torch.optim.SGD, kwargs
    if not kwargs.pop("bias_correction", True):
        raise ValueError(
            "zero config: 'optimizer.params.bias_correction' = false is not supported "
            "(torch's Adam always corrects the bias)"
        )
    kwargs.pop("torch_adam", None)
    adam_w_mode = kwargs.pop("adam_w_mode", True)
    kwargs = {**_ADAM_DEFAULTS, **kwargs}
    kwargs["betas"] = tuple(kwargs["betas"])
    decoupled = kind == "adamw" or bool(adam_w_mode)
    return (torch.optim.AdamW if decoupled else torch.optim.Adam), kwargs


def build_optimizer(
    params: Any, section: Mapping, values: Mapping[str, Any] | None = None
) -> torch.optim.Optimizer:
    """A torch optimizer over ``params`` (tensors or param groups) from an ``optimizer`` section."""
    cls, kwargs = optimizer_spec(section, values)
    optimizer = cls(params, **kwargs)
    optimizer._hf_zero_from_config = True  # ZeroAccelerator then knows the section was applied
    return optimizer


def optimizer_from_config(params: Any, config: Any, **values: Any) -> torch.optim.Optimizer:
    """`build_optimizer` from ``config.optimizer`` (a `ZeroConfig`); ``values`` fill ``"auto"``."""
    if config.optimizer is None:
        raise ValueError("zero config: there is no 'optimizer' section to build from")
    return build_optimizer(params, config.optimizer, values)

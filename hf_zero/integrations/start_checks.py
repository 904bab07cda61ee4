"""Mistakes in a run's arguments that would otherwise surface late: found when they are parsed.

A read-only output folder showed only at the first save, after training up to it; an NVMe path
naming a file only after the model and data had loaded; ``--gradient_accumulation_steps 0`` as a
``ZeroDivisionError`` deep in the Trainer. Each is one line here: `training_argument_problem`
for the Trainer's arguments, `nvme_path_problem` for the config. Under `hf_zero.run` they are
raised while the script parses its arguments (`check_training_arguments_when_parsed`) and
printed as one line with exit status 2; `ZeroTrainingArguments` raises them as ``ValueError``
(the recipes' parser prints those as one line too).
"""

from __future__ import annotations

import functools

from hf_zero.config.zero_config import ZeroConfig
from hf_zero.storage.writable import unwritable_dir

AT_LEAST_ONE = ("per_device_train_batch_size", "gradient_accumulation_steps")


class StartRefused(ValueError):
    """A run that cannot start as asked; the message is the one line to show (`hf_zero.run`
    prints it as ``error: ...`` and exits 2)."""


def training_argument_problem(args) -> str | None:
    """The first mistake in a ``TrainingArguments`` that would stop the run later, or None."""
    for name in AT_LEAST_ONE:
        value = getattr(args, name, 1)
        if isinstance(value, int) and value < 1:
            return f"--{name} {value} is not allowed: at least 1"
    output_dir = getattr(args, "output_dir", None)
    if output_dir:
        return unwritable_dir(output_dir, "--output_dir")
    return None


def nvme_path_problem(config: ZeroConfig) -> str | None:
    """A swap folder of an NVMe tier that is not a writable directory, or None."""
    for tier in ("offload_param", "offload_optimizer"):
        path = config.nvme_path_for(tier) if getattr(config, tier) == "nvme" else None
        if path:
            key = f"--zero_nvme_path ('{tier}_nvme_path' / 'nvme_path')"
            problem = unwritable_dir(path, key)
            if problem:
                return problem
    return None


def check_training_arguments_when_parsed() -> None:
    """Make every ``TrainingArguments`` built later in this process (a script's parser, TRL's
    configs) raise `training_argument_problem` as `StartRefused` before anything else happens
    (`hf_zero.run` prints it as one line and exits 2). Idempotent."""
    from transformers import TrainingArguments

    if getattr(TrainingArguments.__post_init__, "_hf_zero_checked", False):
        return
    original = TrainingArguments.__post_init__

    @functools.wraps(original)  # keeps the marks of earlier patches (`hf_zero.integrations.cpu`)
    def __post_init__(self, *args, **kwargs):
        problem = training_argument_problem(self)
        if problem:
            raise StartRefused(problem)
        return original(self, *args, **kwargs)

    __post_init__._hf_zero_checked = True
    TrainingArguments.__post_init__ = __post_init__

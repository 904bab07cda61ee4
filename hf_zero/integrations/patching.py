"""Point an unmodified script's ``Trainer`` and ``Accelerator`` at hf_zero's, once its settings
are checked (`hf_zero.run` and the ``HF_ZERO_CONFIG`` autoload hook call `activate`)."""

from __future__ import annotations

import os
import sys
from typing import Any

from hf_zero.integrations import active_settings


def activate(values: dict[str, Any] | None = None, config_file: str | None = None) -> None:
    """Validate the settings, remember them and point ``transformers.Trainer`` at ZeroTrainer."""
    from hf_zero.config.sources import resolve_sources
    from hf_zero.integrations.cpu import cpu_training_arguments, use_cpu_processes
    from hf_zero.integrations.start_checks import (
        check_training_arguments_when_parsed,
        nvme_path_problem,
    )

    # Bad settings fail before the script runs, including those that depend on the number of
    # processes the launcher started, and swap folders that cannot be written.
    config = resolve_sources(values or {}, config_file, precision_from_run=True)
    config.check_world(launched_world_size())
    problem = nvme_path_problem(config)
    if problem:
        raise ValueError(problem)
    active_settings.remember(values or {}, config_file)
    use_cpu_processes()
    cpu_training_arguments()
    check_training_arguments_when_parsed()  # --output_dir, --gradient_accumulation_steps
    patch_trainer()
    patch_accelerator()


def launched_world_size() -> int:
    """The number of processes the launcher started (1 for a plain ``python``)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def patch_trainer() -> None:
    """Make ``transformers.Trainer`` (both import paths) `ZeroTrainer`. Idempotent."""
    import transformers.trainer as trainer_module

    from hf_zero.integrations.trainer import ZeroTrainer

    trainer_module.Trainer = ZeroTrainer
    # transformers' lazy top-level module may have replaced itself in sys.modules while the
    # imports above ran: patch the one `from transformers import Trainer` will read.
    sys.modules["transformers"].Trainer = ZeroTrainer


def patch_accelerator() -> None:
    """Make ``accelerate.Accelerator`` (both import paths) `ZeroAccelerator`. Idempotent.

    A custom loop's ``Accelerator(...)`` then builds hf_zero's engine in ``prepare``; the
    settings come from `active_sources` (and ``$HF_ZERO_CONFIG``).
    """
    import accelerate
    import accelerate.accelerator as accelerator_module

    from hf_zero.integrations.accelerate import ZeroAccelerator

    accelerator_module.Accelerator = ZeroAccelerator
    accelerate.Accelerator = ZeroAccelerator


def hf_zero_was_used() -> bool:
    """Whether this process built a `ZeroAccelerator` (the Trainer builds one) or an engine."""
    from hf_zero.engine.zero_engine import ZeroEngine

    accelerate = sys.modules.get("hf_zero.integrations.accelerate")
    made = getattr(getattr(accelerate, "ZeroAccelerator", None), "instances_created", 0)
    return made > 0 or ZeroEngine.instances_created > 0

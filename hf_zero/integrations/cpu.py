"""Several CPU processes are one data-parallel group, whatever the script says.

Accelerate and the Trainer treat processes started by ``accelerate launch`` / ``torchrun`` on a
machine without a GPU as independent single processes unless ``use_cpu`` (Trainer),
``cpu=True`` (Accelerator) or ``ACCELERATE_USE_CPU`` says otherwise. Each then reads the whole
dataset and believes it is the main process, while hf_zero's engine shards over all of them:
both ranks train on the same batches and write the same files. hf_zero therefore turns the CPU
switch on itself whenever there is no CUDA device, exactly as a user typing ``--use_cpu`` would.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from hf_zero.comm.topology import init_distributed

CPU_ENV = "ACCELERATE_USE_CPU"


def no_gpu() -> bool:
    """True when this process has no CUDA device to run on (hf_zero then computes on the CPU)."""
    return not torch.cuda.is_available()


def use_cpu_processes() -> None:
    """Make every Accelerator / TrainingArguments built later in this process treat the
    launched processes as one CPU group (``ACCELERATE_USE_CPU=true``), when there is no GPU."""
    if no_gpu():
        os.environ.setdefault(CPU_ENV, "true")


def ensure_cpu_args(args) -> None:
    """Give a ``TrainingArguments`` built without ``use_cpu`` the CPU switch when there is no GPU.

    Call it before an Accelerator exists (the Trainer builds one in ``__init__``). When the
    arguments already set their devices up without the switch, the set-up is redone at once
    (transformers resets Accelerate's shared state when it does so).
    """
    if no_gpu():
        args.dataloader_pin_memory = False  # as use_cpu does: torch warns on every DataLoader
    if not no_gpu() or args.use_cpu or os.environ.get(CPU_ENV, "").lower() in ("1", "true"):
        return  # already one CPU group (the user's flag, or `use_cpu_processes`)
    args.use_cpu = True
    if args.__dict__.pop("_setup_devices", None) is not None:  # functools.cached_property
        _ = args.device


def create_launched_group(backend: str | None, timeout_s: float | None) -> None:
    """Create the launched processes' default group before Accelerate or the Trainer does, so
    that it honours ``timeout_s`` (on CPU they create it without one, ignoring
    ``--ddp_timeout``) and, under a restarting launcher, forms again in a restarted round
    (`hf_zero.comm.elastic`). Only when launched with several processes; nothing if the group
    exists."""
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1 and "MASTER_ADDR" in os.environ
    if launched and not dist.is_initialized():
        init_distributed(backend, timeout=timeout_s)


def cpu_training_arguments() -> None:
    """With no GPU, every ``TrainingArguments`` built later in this process (TRL's configs
    too) sets ``use_cpu`` before its own checks, as a user typing ``--use_cpu`` would: its bf16
    check otherwise refuses ``--bf16`` on a CPU ("Your setup doesn't support bf16/gpu").
    Idempotent."""
    from transformers import TrainingArguments

    if not no_gpu() or getattr(TrainingArguments.__post_init__, "_hf_zero_cpu", False):
        return
    original = TrainingArguments.__post_init__

    def __post_init__(self, *args, **kwargs):
        self.use_cpu = True
        return original(self, *args, **kwargs)

    __post_init__._hf_zero_cpu = True
    TrainingArguments.__post_init__ = __post_init__

"""`ZeroTrainingArguments`: ``TrainingArguments`` plus hf_zero's flags, made from the settings
table (`hf_zero.config.settings.SETTINGS`): one field per setting, ``zero_<key>``, one per older
spelling (an alias of it), and ``zero_config``.

Settings, by precedence: command-line flags > ``--zero_config`` (hf_zero YAML/JSON or a
DeepSpeed JSON) > ``$HF_ZERO_CONFIG`` > defaults. A flag that contradicts the ``--zero_config``
file is an error; so is a DeepSpeed value that contradicts the Trainer's own arguments (batch
size, accumulation, clipping, precision), as in the DeepSpeed integration. ``"auto"`` values are
filled from the Trainer's arguments. All of it is checked when the arguments are built, before
any process group exists.
"""

from __future__ import annotations

import dataclasses
import os

import torch
from transformers import TrainingArguments

from hf_zero.config.checks import AUTO
from hf_zero.config.settings import CONFIG_FILE_FLAG, CONFIG_FILE_HELP, SETTINGS, merge_spellings
from hf_zero.config.sources import ENV_VAR, explicit_values, resolve_sources
from hf_zero.config.zero_config import ZeroConfig
from hf_zero.integrations.cpu import create_launched_group
from hf_zero.integrations.start_checks import nvme_path_problem, training_argument_problem
from hf_zero.optim.deepspeed_optimizer import (
    optimizer_spec,
    resolve_params,
    trainer_values,
    type_and_params,
)
from hf_zero.optim.deepspeed_schedules import SCHEDULERS

SPELLINGS = [name for s in SETTINGS for name in s.names]
"""Every ``ZeroTrainingArguments`` field that sets a config key (canonical, then aliases)."""


def _fields() -> list[tuple[str, object, dataclasses.Field]]:
    out = [
        (
            CONFIG_FILE_FLAG,
            str | None,
            dataclasses.field(default=None, metadata={"help": CONFIG_FILE_HELP}),
        )
    ]
    for s in SETTINGS:
        for name in s.names:
            text = s.help if name == s.flag else f"the same as --{s.flag}"
            out.append(
                (name, s.kind | None, dataclasses.field(default=None, metadata={"help": text}))
            )
    return out


class _ZeroArguments:
    """The methods of `ZeroTrainingArguments` (its fields come from the settings table)."""

    def __post_init__(self) -> None:
        # Checked first: bad settings fail before TrainingArguments touches any device, and
        # folders that cannot be written before anything is trained.
        problem = training_argument_problem(self)
        if problem:
            raise ValueError(problem)
        self.zero = self.resolve_zero_config()
        problem = nvme_path_problem(self.zero)
        if problem:
            raise ValueError(problem)
        if "WORLD_SIZE" in os.environ:  # launched: the process count is known now
            self.zero.check_world(int(os.environ["WORLD_SIZE"]))
        if not torch.cuda.is_available():
            self.use_cpu = True
        create_launched_group(self.ddp_backend, self.zero.comm_timeout)  # = --ddp_timeout
        if self.zero.pp_size > 1:  # every micro-batch of a pipeline step the same size
            self.dataloader_drop_last = True
        super().__post_init__()

    def zero_setting_given(self, key: str) -> bool:
        """Whether ZeroConfig field ``key`` was set by a flag, ``--zero_config`` or
        ``$HF_ZERO_CONFIG`` (recipes use it to pick their own defaults without overriding you)."""
        if key in merge_spellings({n: getattr(self, n) for n in SPELLINGS})[0]:
            return True
        env_file = os.environ.get(ENV_VAR) or None
        return key in {**explicit_values(env_file), **explicit_values(self.zero_config)}

    def resolve_zero_config(self) -> ZeroConfig:
        """The effective `ZeroConfig`; raises ``ValueError`` on contradictions."""
        cli, given_as = merge_spellings({n: getattr(self, n) for n in SPELLINGS})
        return zero_config_for(self, cli, self.zero_config, given_as)


ZeroTrainingArguments = dataclasses.make_dataclass(
    "ZeroTrainingArguments",
    _fields(),
    bases=(_ZeroArguments, TrainingArguments),
    namespace={
        "__doc__": "``TrainingArguments`` plus hf_zero's flags (``--zero_stage``, "
        "``--zero_config``, ...: `hf_zero.config.settings`). With no CUDA device ``use_cpu`` "
        "turns on.",
        "__module__": __name__,
    },
)


def zero_config_for(
    args: TrainingArguments,
    cli: dict | None = None,
    zero_config: str | None = None,
    given_as: dict[str, str] | None = None,
) -> ZeroConfig:
    """The `ZeroConfig` for a run with these Trainer arguments: ``cli`` values (field names) >
    the ``zero_config`` file > ``$HF_ZERO_CONFIG``; ``"auto"`` filled from ``args``.

    Raises ``ValueError`` when a file contradicts the Trainer's own batch size, accumulation,
    clipping or precision (as the DeepSpeed integration does).
    """
    flag_names = {**{s.key: s.flag for s in SETTINGS}, **(given_as or {})}
    env_file = os.environ.get(ENV_VAR) or None
    explicit = {**explicit_values(env_file), **explicit_values(zero_config)}
    config = resolve_sources(cli or {}, zero_config, flag_names=flag_names, precision_from_run=True)
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    if "comm_timeout" not in explicit and (cli or {}).get("comm_timeout") is None:
        config.comm_timeout = args.ddp_timeout  # one timeout for every group of the run
    trainer_values = {
        "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "gradient_clipping": args.max_grad_norm,
        "precision": precision,
    }
    for key, ours in trainer_values.items():
        theirs = explicit.get(key)
        if key == "precision" and ours == "fp32":
            continue  # no --bf16/--fp16 given: the zero config decides
        if theirs not in (None, AUTO) and theirs != ours:
            source = zero_config or env_file
            raise ValueError(
                f"hf_zero: '{key}' = {theirs!r} in {source} contradicts the "
                f"Trainer's arguments ({key} = {ours!r}); set it to 'auto' or make them agree"
            )
    if explicit.get("precision") in (None, AUTO):
        config.precision = AUTO  # filled from --bf16/--fp16 just below
    config = config.resolved(
        micro_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_grad_norm=args.max_grad_norm,
        precision=precision,
        final=False,  # bucket sizes and thresholds follow the model in initialize()
    )
    _check_sections(config, args)
    return config


def _check_sections(config: ZeroConfig, args: TrainingArguments) -> None:
    """Refuse an unknown optimizer/scheduler type or key now, not after the model is built."""
    if config.optimizer is not None:
        optimizer_spec(config.optimizer, trainer_values(args))
    if config.scheduler is not None:
        name, params = type_and_params("scheduler", config.scheduler, SCHEDULERS)
        allowed = {*SCHEDULERS[name].DEFAULTS, *SCHEDULERS[name].REQUIRED}
        resolve_params("scheduler", params, allowed, trainer_values(args, 1))

"""`ZeroTrainingArguments` and `ZeroTrainer`: hf_zero under the Hugging Face Trainer.

Settings, by precedence: command-line flags > ``--zero_config`` (hf_zero YAML/JSON or a
DeepSpeed JSON) > ``$HF_ZERO_CONFIG`` > defaults. A flag that contradicts the ``--zero_config``
file is an error; so is a DeepSpeed value that contradicts the Trainer's own arguments (batch
size, accumulation, clipping, precision), as in the DeepSpeed integration. ``"auto"`` values are
filled from the Trainer's arguments. All of it is checked when the arguments are built, before
any process group exists.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import torch
import transformers.trainer as trainer_module
from transformers import Trainer, TrainingArguments
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME

from hf_zero.config import AUTO, CLI_FLAGS, ENV_VAR, ZeroConfig, explicit_values, resolve_sources
from hf_zero.integrations.accelerate import ZeroAccelerator, ZeroPlugin

ZERO_DIR = "zero"  # the engine's sharded checkpoint inside a Trainer checkpoint directory

FLAGS = CLI_FLAGS  # --flag -> ZeroConfig field


@dataclass
class ZeroTrainingArguments(TrainingArguments):
    """``TrainingArguments`` plus hf_zero's flags. With no CUDA device ``use_cpu`` turns on."""

    zero_stage: int | None = field(
        default=None, metadata={"help": "ZeRO stage: 0, 1, 2 or 3 (default: from --zero_config)"}
    )
    zero_config: str | None = field(
        default=None, metadata={"help": "hf_zero YAML/JSON or a DeepSpeed JSON config file"}
    )
    offload_optimizer: str | None = field(
        default=None, metadata={"help": "'cpu': optimizer state and master weights in CPU memory"}
    )
    zero_quantized_weights: bool | None = field(
        default=None, metadata={"help": "ZeRO++ qwZ: INT8 weight all-gather (stage 3)"}
    )
    zero_hpz_partition_size: int | None = field(
        default=None, metadata={"help": "ZeRO++ hpZ: secondary partition size (stage 3)"}
    )
    zero_quantized_gradients: bool | None = field(
        default=None, metadata={"help": "ZeRO++ qgZ: quantized gradient reduction"}
    )
    zero_quantized_nontrainable_weights: bool | None = field(
        default=None, metadata={"help": "MixZ++: frozen weights kept as INT8 shards (stage 3)"}
    )
    tp_size: int | None = field(default=None, metadata={"help": "tensor-parallel size (AutoTP)"})

    def __post_init__(self) -> None:
        # Checked first: bad settings fail before TrainingArguments touches any device.
        self.zero = self.resolve_zero_config()
        if not torch.cuda.is_available():
            self.use_cpu = True
        super().__post_init__()

    def zero_setting_given(self, key: str) -> bool:
        """Whether ZeroConfig field ``key`` was set by a flag, ``--zero_config`` or
        ``$HF_ZERO_CONFIG`` (recipes use it to pick their own defaults without overriding you)."""
        if any(getattr(self, flag) is not None for flag, name in FLAGS.items() if name == key):
            return True
        env_file = os.environ.get(ENV_VAR) or None
        return key in {**explicit_values(env_file), **explicit_values(self.zero_config)}

    def resolve_zero_config(self) -> ZeroConfig:
        """The effective `ZeroConfig`; raises ``ValueError`` on contradictions."""
        cli = {name: getattr(self, flag) for flag, name in FLAGS.items()}
        return zero_config_for(self, cli, self.zero_config)


def zero_config_for(
    args: TrainingArguments, cli: dict | None = None, zero_config: str | None = None
) -> ZeroConfig:
    """The `ZeroConfig` for a run with these Trainer arguments: ``cli`` values (field names) >
    the ``zero_config`` file > ``$HF_ZERO_CONFIG``; ``"auto"`` filled from ``args``.

    Raises ``ValueError`` when a file contradicts the Trainer's own batch size, accumulation,
    clipping or precision (as the DeepSpeed integration does).
    """
    flag_names = {name: flag for flag, name in FLAGS.items()}
    config = resolve_sources(cli or {}, zero_config, flag_names=flag_names)
    env_file = os.environ.get(ENV_VAR) or None
    explicit = {**explicit_values(env_file), **explicit_values(zero_config)}
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
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
    return config.resolve_auto(
        micro_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_grad_norm=args.max_grad_norm,
        precision=precision,
        final=False,  # bucket sizes and thresholds follow the model in initialize()
    )


class ZeroTrainerMixin:
    """Put hf_zero under any ``Trainer`` subclass: ``class MyTrainer(ZeroTrainerMixin, SFTTrainer)``.

    The model and optimizer run on hf_zero's engine.

    ``save_model`` gathers the weights first, so ``from_pretrained`` loads what it writes (for a
    PEFT model: the adapter, in PEFT format, under every stage). Checkpoints keep the sharded
    optimizer state as one file per rank; ``resume_from_checkpoint`` restores it exactly. Logs
    add ``grad_norm_pre_clip`` (the Trainer's ``grad_norm`` is the same pre-clip value),
    ``grad_norm_post_clip``, ``loss_scale`` (fp16), this rank's memory by kind and the bytes
    communicated per optimizer step.
    """

    def __init__(self, *args, zero_config: ZeroConfig | None = None, **kwargs) -> None:
        self._zero_config = zero_config
        self._comm_bytes_logged = 0
        self._steps_logged = 0
        super().__init__(*args, **kwargs)

    @property
    def engine(self):
        return getattr(self.accelerator, "engine", None)

    def create_accelerator_and_postprocess(self) -> None:
        config = self._zero_config or getattr(self.args, "zero", None)
        if config is None:
            # Plain TrainingArguments: `hf_zero.run`'s flags, if active, and $HF_ZERO_CONFIG.
            from hf_zero.run import active_sources

            config = zero_config_for(self.args, *active_sources())
        plugin = ZeroPlugin(config)
        # The Trainer builds `Accelerator(**args)` inline; swap the class for that one call.
        original = trainer_module.Accelerator
        trainer_module.Accelerator = functools.partial(ZeroAccelerator, zero_plugin=plugin)
        try:
            super().create_accelerator_and_postprocess()
        finally:
            trainer_module.Accelerator = original

    # --- saving ------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        output_dir = output_dir or self.args.output_dir
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        state_dict = self.engine.full_state_dict()  # collective: every rank gathers
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            model = self.accelerator.unwrap_model(self.model)
            model.save_pretrained(output_dir, state_dict=state_dict)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        self.accelerator.wait_for_everyone()

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.engine is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        self.engine.save_checkpoint(os.path.join(output_dir, ZERO_DIR))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or self.engine is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        self.engine.load_checkpoint(os.path.join(checkpoint, ZERO_DIR))
        scheduler = torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True)
        self.lr_scheduler.load_state_dict(scheduler)

    # --- logging -----------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        engine = self.engine
        if engine is not None and "loss" in logs:
            steps = self.state.global_step - self._steps_logged
            comm = engine.comm_stats.bytes()
            if steps > 0:
                logs["comm_MB_per_step"] = round(
                    (comm - self._comm_bytes_logged) / steps / 2**20, 3
                )
            self._comm_bytes_logged, self._steps_logged = comm, self.state.global_step
            if "grad_norm" in logs:
                logs["grad_norm_pre_clip"] = logs["grad_norm"]
            if engine.grad_norm_post_clip is not None:
                logs["grad_norm_post_clip"] = engine.grad_norm_post_clip
            if engine.config.precision == "fp16":
                logs["loss_scale"] = engine.loss_scale
            for kind, nbytes in engine.memory_report().items():
                if nbytes:
                    logs[f"mem_MB_{kind}"] = round(nbytes / 2**20, 3)
        super().log(logs, start_time)


class ZeroTrainer(ZeroTrainerMixin, Trainer):
    """A ``Trainer`` whose model and optimizer run on hf_zero's engine (see `ZeroTrainerMixin`)."""

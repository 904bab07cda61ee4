"""`ZeroTrainer`: hf_zero under the Hugging Face Trainer (its arguments: `ZeroTrainingArguments`,
`hf_zero.integrations.trainer_arguments`). The Trainer's own loop, checkpoints and logs stay
as they are; its Accelerator is `ZeroAccelerator`, which builds the engine.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import transformers.trainer as trainer_module
from transformers import Trainer, TrainerCallback
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME

from hf_zero.config.checks import AUTO
from hf_zero.config.zero_config import ZeroConfig
from hf_zero.engine.pretrained_save import streamable
from hf_zero.integrations.accelerate import ZeroAccelerator, ZeroPlugin
from hf_zero.integrations.cpu import ensure_cpu_args
from hf_zero.integrations.preemption import SaveOnSigterm
from hf_zero.integrations.run_claim import claim_run
from hf_zero.integrations.trainer_arguments import zero_config_for
from hf_zero.integrations.trainer_checkpoints import ZERO_DIR, record_saved_dtype, save_staged
from hf_zero.optim.deepspeed_optimizer import (
    optimizer_spec,
    trainer_values,
)
from hf_zero.optim.deepspeed_schedules import build_scheduler
from hf_zero.sharding.stage3.partitioned_init import is_partitioned, load_partitioned
from hf_zero.sharding.stage3.units import num_parameters

logger = logging.getLogger(__name__)

COMM_LOG_KEYS = ("comm_wire_MiB_per_step", "comm_paper_MiB_per_step")
"""Logged per step: bytes this rank sent (every purpose), ZeRO traffic's paper volume."""


class ZeroTrainerMixin:
    """Put hf_zero under any ``Trainer`` subclass: ``class MyTrainer(ZeroTrainerMixin, SFTTrainer)``.

    The model and optimizer run on hf_zero's engine.

    ``save_model`` gathers the weights first, so ``from_pretrained`` loads what it writes (for a
    PEFT model: the adapter, in PEFT format, under every stage). Checkpoints keep the sharded
    optimizer state as one file per rank; ``resume_from_checkpoint`` restores it exactly. Logs
    add ``grad_norm_pre_clip`` (the Trainer's ``grad_norm`` is the same pre-clip value),
    ``grad_norm_post_clip``, ``loss_scale`` (fp16), this rank's memory by kind and its traffic
    per optimizer step: ``comm_wire_MiB_per_step`` (what this rank sent, ZeRO, TP, SP, pipeline
    and control traffic together) and ``comm_paper_MiB_per_step`` (the ZeRO traffic by the ZeRO paper's
    volume convention); see `hf_zero.comm.stats`.
    """

    def __init__(self, *args, zero_config: ZeroConfig | None = None, **kwargs) -> None:
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None:
            ensure_cpu_args(training_args)  # no GPU: the launched processes are one CPU group
        self._zero_config = zero_config
        self._pp_window: list[dict] = []  # pipeline: the micro-batches of the current step
        self._comm_bytes_logged = (0, 0)  # wire, paper
        self._steps_logged = 0
        super().__init__(*args, **kwargs)
        self._warn_sections_overridden()
        self.add_callback(ProfileLogging())
        self.add_callback(SaveOnSigterm())

    @property
    def engine(self):
        return getattr(self.accelerator, "engine", None)

    def create_accelerator_and_postprocess(self) -> None:
        config = self._zero_config or getattr(self.args, "zero", None)
        if config is None:
            # Plain TrainingArguments: `hf_zero.run`'s flags, if active, and $HF_ZERO_CONFIG.
            from hf_zero.integrations.active_settings import active_sources

            config = zero_config_for(self.args, *active_sources())
        if config.pp_size > 1:
            self.args.dataloader_drop_last = True  # every micro-batch of a step the same size
            # train_batch clips (the Trainer's own clipping call only reads the norm back).
            config = config.replace(gradient_clipping=float(self.args.max_grad_norm or 0.0))
        plugin = ZeroPlugin(config)
        plugin.trainer_managed = True  # the Trainer accumulates and clips itself
        self._zero_sections = plugin.config  # its DeepSpeed optimizer/scheduler sections
        # The Trainer builds `Accelerator(**args)` inline; swap the class for that one call.
        original = trainer_module.Accelerator
        trainer_module.Accelerator = functools.partial(ZeroAccelerator, zero_plugin=plugin)
        try:
            super().create_accelerator_and_postprocess()
        finally:
            trainer_module.Accelerator = original

    # --- the config's DeepSpeed optimizer and scheduler sections ------------------------------
    def _section(self, name: str) -> dict | None:
        return getattr(getattr(self, "_zero_sections", None), name, None)

    def _info(self, message: str, *args) -> None:
        if self.args.process_index == 0:
            logger.info(message, *args)

    def _warn_sections_overridden(self) -> None:
        # transformers' DeepSpeed integration would drop the objects passed to the Trainer; an
        # object passed in code is the more deliberate choice, so it wins, with a warning.
        passed = {
            "optimizer": self.optimizer is not None or self._optimizer_cls_given(),
            "scheduler": self.lr_scheduler is not None,
        }
        for name, given in passed.items():
            if given and self._section(name) is not None and self.args.process_index == 0:
                logger.warning(
                    "hf_zero: the zero config's '%s' section is overridden by the %s passed "
                    "to the Trainer",
                    name,
                    name,
                )

    def _optimizer_cls_given(self) -> bool:
        return getattr(self, "optimizer_cls_and_kwargs", None) is not None

    def _warn_differences(self, name: str, values: dict, keys) -> None:
        # Explicit values that differ from the Trainer's arguments win (transformers' DeepSpeed
        # integration raises instead), so say that the run does not follow those arguments.
        params = self._section(name).get("params") or {}
        differ = [
            f"{name}.params.{k} = {params[k]!r} (Trainer: {values[k]!r})"
            for k in keys
            if params.get(k, AUTO) != AUTO and _differs(params[k], values.get(k))
        ]
        if differ and self.args.process_index == 0:
            logger.warning("hf_zero: the zero config wins over the Trainer's arguments: %s", differ)

    def create_optimizer(self, model=None):
        section = self._section("optimizer")
        if section is None or self.optimizer is not None or self._optimizer_cls_given():
            return super().create_optimizer(model)
        values = trainer_values(self.args)
        cls, kwargs = optimizer_spec(section, values)
        self._warn_differences("optimizer", values, ("lr", "betas", "eps", "weight_decay"))
        # The Trainer's usual groups: no weight decay on biases and norms.
        opt_model = self.model if model is None else model
        decay = set(self.get_decay_parameter_names(opt_model))
        named = [(n, p) for n, p in opt_model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": kwargs["weight_decay"]},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        self.optimizer = cls(groups, **kwargs)
        self._info("hf_zero: optimizer %s %s from the zero config", cls.__name__, kwargs)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        section = self._section("scheduler")
        if section is None or self.lr_scheduler is not None:
            return super().create_scheduler(num_training_steps, optimizer)
        values = trainer_values(self.args, num_training_steps)
        keys = ["warmup_max_lr", "total_num_steps"]
        if self.args.get_warmup_steps(num_training_steps) > 0:  # else no warm-up was asked for
            keys.append("warmup_num_steps")
        self._warn_differences("scheduler", values, keys)
        optimizer = self.optimizer if optimizer is None else optimizer
        self.lr_scheduler = build_scheduler(optimizer, section, values)
        self._created_lr_scheduler = True  # re-created by the next train(), as the Trainer does
        self._info(
            "hf_zero: scheduler %s %s from the zero config", section["type"], section.get("params")
        )
        return self.lr_scheduler

    # --- pipeline stages (pp_size > 1): one train_batch per optimizer step ------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        """Pipeline stages need the whole window at once: each micro-batch is kept until the
        last one of the step, then the window runs as one ``train_batch`` (schedule, clipping,
        optimizer step). Returns the mean micro-batch loss on the step's last micro-batch and 0
        before it, so the Trainer's running sum is the step's loss."""
        if not getattr(self.engine, "is_pipeline", False):
            return super().training_step(model, inputs, num_items_in_batch)
        from hf_zero.pipeline.batching import join_microbatches

        self._pp_window.append(inputs)
        if not self.accelerator.sync_gradients:
            return torch.zeros((), device=self.args.device)
        batch = join_microbatches(self._pp_window)
        loss = self.engine.train_batch(batch, microbatches=len(self._pp_window))
        self._pp_window = []
        return torch.tensor(loss, device=self.args.device)

    def evaluation_loop(self, *args, **kwargs):
        """Before ``train()`` the model has no engine yet; the accelerator then evaluates it as it
        is (whole) instead of building an evaluation-only engine that would freeze it."""
        if getattr(self.model, "_hf_zero_engine", None) is None:
            self.accelerator.before_training = self.model
        try:
            return super().evaluation_loop(*args, **kwargs)
        finally:
            self.accelerator.before_training = None

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Pipeline stages: the evaluation loss only (each batch as one micro-batch); the
        logits stay on the last stage."""
        if not getattr(self.engine, "is_pipeline", False):
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        from hf_zero.pipeline.batching import join_microbatches

        loss = self.engine.eval_batch(join_microbatches([inputs]), microbatches=1)
        return torch.tensor(loss, device=self.args.device), None, None

    # --- saving ------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        output_dir = output_dir or self.args.output_dir
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        model = self.accelerator.unwrap_model(self.model)
        save = self.args.should_save
        if not self.engine.is_pipeline and streamable(self.engine):
            self.engine.save_pretrained(output_dir, is_main_process=save)  # group by group
        elif hasattr(model, "peft_config") and not self.engine.is_pipeline:
            from hf_zero.integrations.reload import save_training_record, saved_adapter

            state_dict, samples = saved_adapter(self.engine, model, keep=save)  # never the base
            if save:
                save_training_record(self.engine, model, output_dir, samples=samples)
                model.save_pretrained(output_dir, state_dict=state_dict)
        else:
            state_dict = self.engine.saved_state_dict()  # collective: every rank gathers
            if save:
                dtypes = [v.dtype for v in state_dict.values() if v.is_floating_point()]
                model.save_pretrained(output_dir, state_dict=state_dict)  # may empty state_dict
                record_saved_dtype(model, dtypes[0] if dtypes else None, output_dir)
        if save:
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

    def _save_checkpoint(self, model, trial) -> None:
        if self.engine is None:
            return super()._save_checkpoint(model, trial)
        if getattr(self, "_run_claim", None) is None:  # a save outside train()
            self._run_claim = claim_run(self, None)
        save = functools.partial(super()._save_checkpoint, model, trial)
        save_staged(self, trial, save, self._run_claim)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        target = model or self.model
        if is_partitioned(target) and not hasattr(target, "peft_config"):
            # Its weights are slices until initialize adopts them: each rank reads its own.
            load_partitioned(target, resume_from_checkpoint)
            return None
        return super()._load_from_checkpoint(resume_from_checkpoint, model)

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
            stats = engine.comm_stats
            comm = (stats.wire_bytes(), stats.paper_bytes(purpose="zero"))
            if steps > 0:
                for key, now, before in zip(COMM_LOG_KEYS, comm, self._comm_bytes_logged):
                    logs[key] = round((now - before) / steps / 2**20, 3)
            self._comm_bytes_logged, self._steps_logged = comm, self.state.global_step
            if "grad_norm" in logs:
                logs["grad_norm_pre_clip"] = logs["grad_norm"]
            if engine.grad_norm_post_clip is not None:
                logs["grad_norm_post_clip"] = engine.grad_norm_post_clip
            if engine.config.precision == "fp16":
                logs["loss_scale"] = engine.loss_scale
            for kind, nbytes in engine.memory_report().items():
                if nbytes:
                    logs[f"mem_MiB_{kind}"] = round(nbytes / 2**20, 3)
        profiler = getattr(engine, "profiler", None)
        if profiler is not None and profiler.done and not profiler.logged:
            logs.update(profiler.metrics)  # once: the summary of the profiled steps
            profiler.logged = True
        super().log(logs, start_time)
        if profiler is not None and profiler.logged and profiler.exit_requested:
            profiler.exit()  # `hf-zero doctor -- <command>`: profiled, logged, done

    # --- parameter counts (ZeRO-3: p.numel() is 0 for a released parameter) ------------------
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        # Where to start (auto / a restarted round: the latest complete checkpoint), with the
        # output folder taken for this run; refused on every rank together.
        self._run_claim = claim_run(self, resume_from_checkpoint, getattr(self, "_run_claim", None))
        resume_from_checkpoint = self._run_claim.resume
        # The "Number of trainable parameters" line comes from transformers.trainer's
        # get_model_param_count, which reads the whole size (ds_numel) only under DeepSpeed.
        original = trainer_module.get_model_param_count
        trainer_module.get_model_param_count = _whole_param_count
        try:
            result = super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            trainer_module.get_model_param_count = original
        if getattr(self.engine, "is_pipeline", False):
            # Each rank held only its stages: refill the model so that model(...) runs on every
            # rank after train(), as it does without pipeline stages.
            self.engine.gather_whole_model()
        return result

    def floating_point_ops(self, inputs) -> int:
        main_input = getattr(self.model, "main_input_name", "input_ids")
        if (
            self.engine is None
            or main_input not in inputs
            or not hasattr(self.model, "num_parameters")
        ):
            return super().floating_point_ops(inputs)
        return 6 * inputs[main_input].numel() * num_parameters(self.model, exclude_embeddings=True)


class ProfileLogging(TrainerCallback):
    """With ``profile: true``: log the profile's summary at the step it ends (see `log`)."""

    @staticmethod
    def _profiler(model):
        return getattr(getattr(model, "_hf_zero_engine", None), "profiler", None)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        profiler = self._profiler(model)
        if profiler is not None:
            profiler.defer_exit = True  # the run ends after the summary is logged

    def on_step_end(self, args, state, control, model=None, **kwargs):
        profiler = self._profiler(model)
        if profiler is not None and profiler.done and not profiler.logged:
            control.should_log = True


def _differs(ours, theirs) -> bool:
    if isinstance(ours, (list, tuple)) and isinstance(theirs, (list, tuple)):
        return [float(x) for x in ours] != [float(x) for x in theirs]
    return theirs is not None and ours != theirs


def _whole_param_count(model: torch.nn.Module, trainable_only: bool = False) -> int:
    """``transformers.trainer_pt_utils.get_model_param_count``, counting ZeRO-3 parameters whole."""
    return num_parameters(model, only_trainable=trainable_only)


class ZeroTrainer(ZeroTrainerMixin, Trainer):
    """A ``Trainer`` whose model and optimizer run on hf_zero's engine (see `ZeroTrainerMixin`)."""

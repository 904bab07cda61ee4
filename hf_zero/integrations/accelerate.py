"""`ZeroPlugin` and `ZeroAccelerator`: hf_zero inside Accelerate.

Accelerate has no plugin registry, so `ZeroAccelerator` subclasses `Accelerator`: ``prepare``
hands the model and optimizer to `hf_zero.initialize` (the model keeps its identity: hooks live
on it, nothing wraps it), and the training-loop calls route to the engine. Data loaders,
schedulers, ``gather_for_metrics`` and the rest are Accelerate's own.

    accelerator = ZeroAccelerator(zero_plugin=ZeroPlugin(stage=3))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)   # returns the pre-clip norm
            optimizer.step(); scheduler.step(); optimizer.zero_grad()

With no CUDA device, the processes an accelerate YAML starts (``distributed_type: MULTI_GPU``)
become one gloo group on the CPU without further settings.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import accelerate.accelerator as accelerator_module
import numpy as np
import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler

from hf_zero.config.zero_config import ZeroConfig
from hf_zero.engine import Engine, ZeroEngine, initialize
from hf_zero.engine.pretrained_save import streamable
from hf_zero.integrations.cpu import create_launched_group
from hf_zero.numerics.packed import disable_cpu_repacking
from hf_zero.optim.deepspeed_schedules import DeepSpeedSchedule
from hf_zero.sharding.stage3.partitioned_init import is_partitioned

logger = logging.getLogger(__name__)

_ACCELERATE_PRECISION = {"no": "fp32", "fp16": "fp16", "bf16": "bf16"}


@dataclass
class ZeroPlugin:
    """hf_zero settings for `ZeroAccelerator`: a `ZeroConfig` (from any source it accepts)."""

    config: ZeroConfig = field(default_factory=ZeroConfig)
    trainer_managed: bool = False
    """Set by `ZeroTrainer`: the Trainer accumulates gradients and clips them itself, so the
    config's ``gradient_accumulation_steps`` and ``gradient_clipping`` are left to it."""

    def __init__(self, config: ZeroConfig | dict | str | None = None, **overrides) -> None:
        self.config = ZeroConfig.load(config, **overrides)
        self.trainer_managed = False

    def adopt_mixed_precision(self, mixed_precision: str | None) -> None:
        """Take Accelerate's ``mixed_precision`` as the compute dtype, unless the config set one.

        hf_zero casts the model and keeps fp32 master weights itself, so Accelerate's autocast
        and GradScaler stay off. A config precision that contradicts it raises.
        """
        if mixed_precision is None:
            return
        wanted = _ACCELERATE_PRECISION.get(str(mixed_precision))
        if wanted is None:
            raise ValueError(
                f"hf_zero: mixed_precision = {mixed_precision!r} is not supported; allowed: "
                + ", ".join(_ACCELERATE_PRECISION)
            )
        current = self.config.precision
        if current == "auto" or (current == "fp32" and wanted != "fp32"):
            self.config.precision = wanted
        elif current != wanted and wanted != "fp32":
            raise ValueError(
                f"hf_zero: the zero config says precision = {current!r} but Accelerate's "
                f"mixed_precision is {mixed_precision!r}; make them agree"
            )


class ZeroAcceleratedOptimizer(AcceleratedOptimizer):
    """The optimizer Accelerate hands back: ``step``/``zero_grad`` go through the engine."""

    def __init__(self, engine: ZeroEngine) -> None:
        super().__init__(engine.optimizer.optimizer, device_placement=False, scaler=None)
        self.engine = engine

    def step(self, closure=None):
        if self.gradient_state.sync_gradients:
            self.engine.step()

    def zero_grad(self, set_to_none=None):
        if self.gradient_state.sync_gradients:
            self.engine.zero_grad()

    @property
    def step_was_skipped(self) -> bool:
        """True when fp16 loss scaling skipped the last step (schedulers then hold still)."""
        return self.engine.last_step_skipped


class PipelineAcceleratedOptimizer(AcceleratedOptimizer):
    """With ``pp_size`` > 1, ``engine.train_batch`` steps the optimizer; the loop's ``step`` and
    ``zero_grad`` have nothing left to do (its scheduler still steps the learning rate)."""

    def __init__(self, engine) -> None:
        super().__init__(engine.optimizer.optimizer, device_placement=False, scaler=None)
        self.engine = engine

    def step(self, closure=None):
        pass

    def zero_grad(self, set_to_none=None):
        pass

    @property
    def step_was_skipped(self) -> bool:
        """True when fp16 loss scaling skipped ``train_batch``'s step."""
        return self.engine.last_step_skipped


class ZeroAccelerator(Accelerator):
    """An `accelerate.Accelerator` whose model and optimizer run on hf_zero's ZeRO engine.

    Args:
        zero_plugin: the hf_zero settings; default: ``hf_zero.run``'s flags and
            ``--zero_config`` when it runs the script, over ``$HF_ZERO_CONFIG``, over defaults.
        *args, **kwargs: as for ``Accelerator``. ``mixed_precision`` (or the launcher's
            ``ACCELERATE_MIXED_PRECISION``) becomes the engine's precision.
    """

    instances_created = 0
    """How many were built in this process (``hf_zero.run`` checks that its flags were used)."""

    def __init__(self, *args, zero_plugin: ZeroPlugin | None = None, **kwargs) -> None:
        if zero_plugin is None:
            # `hf_zero.run`'s flags and --zero_config, if active, over $HF_ZERO_CONFIG.
            from hf_zero.config.sources import resolve_sources
            from hf_zero.integrations.active_settings import active_sources

            zero_plugin = ZeroPlugin(resolve_sources(*active_sources(), precision_from_run=True))
        ZeroAccelerator.instances_created += 1
        precision = kwargs.pop("mixed_precision", None) or os.environ.get(
            "ACCELERATE_MIXED_PRECISION"
        )
        zero_plugin.adopt_mixed_precision(precision)
        if not torch.cuda.is_available():
            kwargs.setdefault("cpu", True)  # several CPU processes: one gloo group
        if not zero_plugin.trainer_managed:
            _adopt_accumulation(zero_plugin.config, kwargs)
            if zero_plugin.config.save_on_sigterm:
                raise NotImplementedError(
                    "hf_zero: 'save_on_sigterm' works under the Trainer only: an Accelerate loop "
                    "owns its steps and where it saves. Handle SIGTERM in the loop (call "
                    "accelerator.save_state at a step boundary), or run it under the Trainer"
                )
        timeout = zero_plugin.config.comm_timeout
        create_launched_group(None, timeout if isinstance(timeout, (int, float)) else None)
        super().__init__(*args, mixed_precision="no", **kwargs)
        self.zero_plugin = zero_plugin
        self.engine: ZeroEngine | None = None
        self.before_training: torch.nn.Module | None = None
        """The Trainer's model while ``trainer.evaluate()`` runs before ``trainer.train()``."""

    # --- prepare -----------------------------------------------------------------------------
    def prepare(self, *args, device_placement=None):
        models = [a for a in args if isinstance(a, torch.nn.Module)]
        optimizers = [
            a
            for a in args
            if isinstance(a, torch.optim.Optimizer) and not isinstance(a, AcceleratedOptimizer)
        ]
        if len(models) > 1 or len(optimizers) > 1:
            raise ValueError("hf_zero: ZeroAccelerator prepares one model and one optimizer")
        if models and optimizers:
            self.engine = self._make_engine(models[0], optimizers[0])
            pipeline = getattr(self.engine, "is_pipeline", False)
            wrapped = (PipelineAcceleratedOptimizer if pipeline else ZeroAcceleratedOptimizer)(
                self.engine
            )
            args = tuple(wrapped if a is optimizers[0] else a for a in args)
        elif optimizers and self.engine is None:
            raise ValueError(
                "hf_zero: prepare the model together with its optimizer "
                "(accelerator.prepare(model, optimizer, ...))"
            )
        result = super().prepare(*args, device_placement=device_placement)
        return result

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        """As Accelerate's, but sharded over the data-parallel ranks only: the ranks of one
        tensor-parallel group, of one sequence-parallel group, and the stages of one pipeline,
        must see the same batch."""
        config = self.zero_plugin.config
        tp, pp, sp = config.tp_size, config.pp_size, config.sp_size
        if tp * pp * sp == 1:
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        # Accelerate passes its own process count and index; swap them for this one call.
        original = accelerator_module.prepare_data_loader
        # rank = ((pp_rank * data_size + data_rank) * sp_size + sp_rank) * tp_size + tp_rank
        dp_size = self.num_processes // (tp * pp * sp)
        dp_rank = self.process_index // (tp * sp) % dp_size

        def per_dp_rank(*args, **kwargs):
            return original(*args, **{**kwargs, "num_processes": dp_size, "process_index": dp_rank})

        accelerator_module.prepare_data_loader = per_dp_rank
        try:
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        finally:
            accelerator_module.prepare_data_loader = original

    def _make_engine(self, model: torch.nn.Module, optimizer) -> Engine:
        # Accelerate (or the Trainer) owns accumulation: it scales the loss, skips the sync and
        # steps only at the end of a window, so the engine steps whenever it is asked to. The
        # batch sizes are checked here, with the accumulation that really happens.
        plugin, config = self.zero_plugin, self.zero_plugin.config
        gas = config.gradient_accumulation_steps
        gas = gas if plugin.trainer_managed else self.gradient_accumulation_steps
        if isinstance(gas, int):
            dp_size = self.num_processes // (config.tp_size * config.pp_size * config.sp_size)
            config.replace(gradient_accumulation_steps=gas).check_batch_sizes(dp_size)
        if config.pp_size > 1:
            return self._make_pipeline_engine(model, optimizer, gas)
        # Outside the Trainer the config's clipping applies at each step, unless the loop calls
        # clip_grad_norm_ itself in that window (its call then applies; the norm is taken once).
        # The Trainer clips with its own max_grad_norm (the same value) and keeps that as it was.
        clip = config.gradient_clipping
        clip = 0.0 if plugin.trainer_managed or not isinstance(clip, (int, float)) else clip
        config = config.replace(
            gradient_accumulation_steps=1,
            gradient_clipping=float(clip),
            train_batch_size=None,
            scheduler=None,  # the loop (or the Trainer) steps its own prepared scheduler
        )
        if not plugin.trainer_managed:
            _warn_unused_sections(config, optimizer)
        engine = initialize(model, optimizer, config)
        model._hf_zero_engine = engine
        # The Trainer calls model.zero_grad() after each step; route it to the engine so that
        # stages 0-1 keep their flat gradient buffers instead of reallocating them.
        model.zero_grad = lambda set_to_none=True: engine.zero_grad()
        return engine

    def _make_pipeline_engine(self, model: torch.nn.Module, optimizer, gas):
        """Pipeline stages: the window's micro-batches are one ``train_batch``, which clips
        (with the Trainer's max_grad_norm, the config's ``gradient_clipping``) and steps."""
        config = self.zero_plugin.config
        clip = config.gradient_clipping
        clip = clip if isinstance(clip, (int, float)) else 0.0
        micro = config.pp_microbatches or (gas if isinstance(gas, int) else None)
        engine = initialize(
            model,
            optimizer,
            config.replace(
                gradient_clipping=float(clip),
                pp_microbatches=micro,
                train_batch_size=None,
                scheduler=None,
            ),
        )
        model._hf_zero_engine = engine
        return engine

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        if getattr(model, "_hf_zero_engine", None) is not None:
            if model not in self._models:
                self._models.append(model)
            return model  # hooks live on the model itself: nothing to wrap
        # An evaluation before training must not let bitsandbytes repack a QLoRA base in place.
        disable_cpu_repacking(model)
        config = self.zero_plugin.config
        if evaluation_mode and config.stage == 3 and config.pp_size == 1:
            if model is self.before_training:
                return self._evaluate_before_training(model)
            return self._prepare_evaluation_model(model)
        if self.engine is None and not evaluation_mode:
            # Preparing a model alone (no optimizer yet): only place it; the engine comes with
            # the optimizer.
            return model.to(self.device)
        return super().prepare_model(model, device_placement, evaluation_mode)

    def _evaluate_before_training(self, model: torch.nn.Module) -> torch.nn.Module:
        """Stage 3, ``trainer.evaluate()`` before ``trainer.train()``: the model will be trained,
        so it is not sharded for evaluation alone (that engine would have no optimizer, and its
        trainable weights would be frozen). It is whole on every rank until training shards it,
        so it is evaluated as it is."""
        if is_partitioned(model):
            raise NotImplementedError(
                "hf_zero: this model was built with partitioned_init() and has no engine yet, so "
                "it cannot be evaluated before training; call trainer.train() first (evaluation "
                "during and after training is sharded), or pass --eval_on_start true"
            )
        logger.info(
            "hf_zero: evaluating before training on the whole model (stage 3 shards it in train())"
        )
        return model.to(self.device)

    def _prepare_evaluation_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Stage 3: a model that is only evaluated (TRL's reference model, a teacher) is
        sharded as the trained one is and gathered unit by unit, with no gradients and no
        optimizer state (DeepSpeed's ``deepspeed.initialize`` without an optimizer)."""
        model.requires_grad_(False)
        config = self.zero_plugin.config.replace(
            gradient_accumulation_steps=1,
            train_batch_size=None,
            optimizer=None,
            scheduler=None,
            gradient_clipping=0.0,
        )
        model._hf_zero_engine = initialize(model, None, config)
        self._models.append(model)
        return model

    def prepare_scheduler(self, scheduler):
        """As Accelerate's, but a DeepSpeed schedule (`deepspeed_schedules`) advances once per
        optimizer step, as in DeepSpeed, not once per process."""
        if not isinstance(scheduler, DeepSpeedSchedule):
            if (
                self.zero_plugin.config.scheduler is not None
                and not self.zero_plugin.trainer_managed
            ):
                logger.warning(
                    "hf_zero: the zero config's 'scheduler' section is not applied to %s; build "
                    "it with hf_zero.optim.deepspeed_schedules.scheduler_from_config",
                    type(scheduler).__name__,
                )
            return super().prepare_scheduler(scheduler)
        wrapped = AcceleratedScheduler(
            scheduler,
            self._optimizers,
            step_with_optimizer=self.step_scheduler_with_optimizer,
            split_batches=True,  # steps once per optimizer step
        )
        self._schedulers.append(wrapped)
        return wrapped

    def prepare_optimizer(self, optimizer, device_placement=None):
        if isinstance(optimizer, ZeroAcceleratedOptimizer):
            self._optimizers.append(optimizer)
            return optimizer
        return super().prepare_optimizer(optimizer, device_placement)

    # --- the training loop -------------------------------------------------------------------
    def backward(self, loss, **kwargs):
        if self.engine is None:
            return super().backward(loss, **kwargs)
        if getattr(self.engine, "is_pipeline", False):
            raise RuntimeError(
                "hf_zero: with pp_size > 1 the model runs in stages on several processes; call "
                "accelerator.engine.train_batch(batch) for each optimizer step instead of "
                "forward / backward / step (the Trainer does this by itself)"
            )
        if self.gradient_accumulation_steps > 1:
            loss = loss / self.gradient_accumulation_steps
        self.engine.backward(loss, scale_wrt_gas=False)

    @contextlib.contextmanager
    def no_sync(self, model):
        if self.engine is None:
            with super().no_sync(model):
                yield
            return
        with self.engine.no_sync():
            yield

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """Clip the global gradient norm across all shards; returns the norm *before* clipping."""
        if self.engine is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        if norm_type != 2:
            raise ValueError(f"hf_zero: clip_grad_norm_ supports norm_type 2, got {norm_type}")
        if getattr(self.engine, "is_pipeline", False):  # train_batch clipped; its norm
            return torch.tensor(self.engine.last_grad_norm or 0.0)
        return torch.tensor(self.engine.clip_grad_norm_(float(max_norm)))

    def get_state_dict(self, model, unwrap=True):
        """The complete state dict, gathered (collective); rank 0 gets it, others ``{}``.
        Each parameter has its dtype before training (``save_16bit_model``: as trained)."""
        engine = getattr(model, "_hf_zero_engine", None) or self.engine
        if engine is None:
            return super().get_state_dict(model, unwrap)
        return engine.saved_state_dict()

    def save_model(self, model, save_directory, max_shard_size="10GB", safe_serialization=True):
        """Hugging Face safetensors written one group at a time (collective; see
        `hf_zero.engine.pretrained_save`), where the engine can stream them; Accelerate's own
        ``save_model`` (the whole state dict on rank 0) otherwise."""
        engine = getattr(model, "_hf_zero_engine", None) or self.engine
        if engine is None or engine.is_pipeline or not safe_serialization or not streamable(engine):  # fmt: skip
            return super().save_model(model, save_directory, max_shard_size, safe_serialization)
        engine.save_pretrained(
            save_directory, is_main_process=self.is_main_process, max_shard_size=max_shard_size
        )
        return None

    def end_training(self) -> None:
        """Wait for every rank, then tear the process group down (as Accelerate does)."""
        if self.num_processes > 1:
            self.wait_for_everyone()  # no rank may leave while another still communicates
        if self.engine is not None and torch.distributed.is_initialized():
            self.engine.topology.destroy()
        super().end_training()

    # --- save_state / load_state -------------------------------------------------------------
    def save_state(self, output_dir: str | None = None, **kwargs) -> str:
        """Sharded engine checkpoint (per-rank files), schedulers and RNG states."""
        if self.engine is None:
            return super().save_state(output_dir, **kwargs)
        output_dir = Path(output_dir or self.project_configuration.project_dir or "checkpoint")
        self.engine.save_checkpoint(output_dir / "zero")
        if self.is_main_process:
            for i, scheduler in enumerate(self._schedulers):
                torch.save(scheduler.state_dict(), output_dir / f"scheduler_{i}.pt")
        torch.save(_rng_state(), output_dir / f"rng_state_{self.process_index}.pt")
        self.wait_for_everyone()
        return str(output_dir)

    def load_state(self, input_dir: str | None = None, **kwargs) -> None:
        if self.engine is None:
            return super().load_state(input_dir, **kwargs)
        input_dir = Path(input_dir)
        self.engine.load_checkpoint(input_dir / "zero")
        for i, scheduler in enumerate(self._schedulers):
            scheduler.load_state_dict(
                torch.load(input_dir / f"scheduler_{i}.pt", weights_only=True)
            )
        _set_rng_state(
            torch.load(input_dir / f"rng_state_{self.process_index}.pt", weights_only=True)
        )


def _adopt_accumulation(config: ZeroConfig, kwargs: dict) -> None:
    """Give Accelerate the config's ``gradient_accumulation_steps`` (> 1) unless the caller set
    one; a different one raises."""
    ours = config.gradient_accumulation_steps
    if isinstance(ours, bool) or not isinstance(ours, int) or ours <= 1:
        return
    plugin = kwargs.get("gradient_accumulation_plugin")
    env = os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
    if plugin is not None:
        theirs, where = plugin.num_steps, "gradient_accumulation_plugin.num_steps"
    elif env:  # Accelerate lets the launcher's value win over the argument
        theirs, where = int(env), "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"
    elif "gradient_accumulation_steps" in kwargs:
        theirs, where = kwargs["gradient_accumulation_steps"], "gradient_accumulation_steps"
    else:
        kwargs["gradient_accumulation_steps"] = ours
        return
    if theirs != ours:
        raise ValueError(
            f"hf_zero: the zero config says gradient_accumulation_steps = {ours} but the "
            f"Accelerator was given {where} = {theirs}; make them agree or set one of them"
        )


def _warn_unused_sections(config: ZeroConfig, optimizer) -> None:
    if config.optimizer is not None and not getattr(optimizer, "_hf_zero_from_config", False):
        logger.warning(
            "hf_zero: the zero config's 'optimizer' section is not applied to the %s passed to "
            "prepare(); build it with hf_zero.optim.deepspeed_optimizer.optimizer_from_config",
            type(optimizer).__name__,
        )


def _rng_state() -> dict:
    """RNG states as tensors and plain values, loadable with ``weights_only=True``."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

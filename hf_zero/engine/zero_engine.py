"""`ZeroEngine`: ZeRO stages 0-3, the engine `initialize` returns unless ``pp_size`` > 1.

The engine wraps the user's model *in place*: parameters become views into flat buckets and hooks
on them drive gradient reduction, so calling ``model(...)`` directly (as the Trainer's evaluation
loop does) keeps working. The engine itself adds the DeepSpeed-style loop calls:
``engine(batch)``, ``engine.backward(loss)``, ``engine.step()``.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path

import torch

from hf_zero import sequence
from hf_zero.comm import CommStats
from hf_zero.config.zero_config import ZeroConfig
from hf_zero.engine import checkpointing, pretrained_save
from hf_zero.engine.full_state_dict import full_state_dict, saved_state_dict
from hf_zero.engine.memory_report import held_memory
from hf_zero.engine.model_checks import check_materialized, check_same_model
from hf_zero.engine.start_line import describe
from hf_zero.engine.start_up import start_up
from hf_zero.engine.surface import Batch, Engine, loss_of, split_batch
from hf_zero.numerics.packed import disable_cpu_repacking, is_packed, quant_state_tensors
from hf_zero.numerics.precision import DTYPES, LossScaler
from hf_zero.optim import ShardedOptimizer
from hf_zero.optim.setup import optimizer_and_scheduler
from hf_zero.profiling import Profiler, profile_settings
from hf_zero.sharding.grouping import GroupBuilder, log_quantization_padding, zeropp_settings
from hf_zero.sharding.reducer import GradientReducer
from hf_zero.sharding.stage3.coordinator import Zero3Coordinator
from hf_zero.sharding.stage3.gathered import gathered_parameters
from hf_zero.sharding.stage3.state_dict import StateDictHooks, mark_whole_shapes
from hf_zero.sharding.stage3.units import true_numel
from hf_zero.sharding.tp import PRESETS, TensorParallel, resolve_plan
from hf_zero.storage.host_memory import HostMemoryPolicy

logger = logging.getLogger(__name__)


class ZeroEngine(Engine):
    """ZeRO stages 0-3 over a model and an elementwise optimizer. Built by `initialize`."""

    instances_created = 0
    """Engines built in this process (``hf_zero.run`` checks that its flags reached one)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        config: ZeroConfig,
        lr_scheduler=None,
    ) -> None:
        self.config = config
        self.module = model
        # Everything that can be refused is checked before any process-group work.
        optimizer, lr_scheduler = optimizer_and_scheduler(model, optimizer, config, lr_scheduler)

        self._connect(config)
        config = self.config  # "auto" resolved, read-only from here on
        self._place_model(model, optimizer)
        self.sequence = sequence.install(model, config, self.topology, self.comm)
        self.host_memory = HostMemoryPolicy(
            self.device.type == "cpu", config.host_memory, config.memory_first, config.stage
        )
        """When freed host memory goes back to the OS (CPU runs)."""
        self.host_memory.start()
        self._build_groups(model, optimizer)
        self.host_memory.after_build()
        self._build_stage3()
        self._build_step(optimizer, lr_scheduler)
        # Count from the first step; what set-up sent (broadcasts, AutoTP, regroup) is kept.
        self.init_comm_stats: CommStats = self.comm.stats.reset()
        ZeroEngine.instances_created += 1
        profiled = profile_settings(config)
        self.profiler = Profiler(self, *profiled) if profiled else None
        if self.topology.rank == 0:
            # Printed, not logged: scripts often set warning-level logging, and this line is
            # how a user sees that hf_zero (and which stage) is really in charge.
            print(f"hf_zero: {self.describe()}", file=sys.stderr, flush=True)

    def _connect(self, config: ZeroConfig) -> None:
        """Process groups, collectives, the stall watchdog; "auto" values resolved."""
        me = weakref.ref(self)
        start = start_up(config, self.module, lambda: getattr(me(), "global_steps", "?"))
        self.config, self.topology, self.comm = start.config, start.topology, start.comm
        self.device, self.watchdog = start.device, start.watchdog
        self.zeropp = zeropp_settings(self.config, self.topology)
        self.dtype = DTYPES[self.config.precision]

    def _place_model(self, model: torch.nn.Module, optimizer) -> None:
        """Check the model (materialised, the same on every rank), move it to this rank's
        device, apply AutoTP and start every replica from rank 0's values."""
        check_materialized(model)
        self.loaded_dtypes = {n: p.dtype for n, p in model.named_parameters(remove_duplicate=False)}
        """Each parameter's dtype before training (a saved model's), by name: AutoTP swaps objects."""
        check_same_model(model, self.comm, self.topology.world, self.device)
        model.to(self.device)
        disable_cpu_repacking(model)
        self.tp: TensorParallel | None = None
        if self.topology.tp_size > 1:
            self._apply_tensor_parallel(optimizer)
        self._broadcast_module()

    def _build_groups(self, model: torch.nn.Module, optimizer) -> None:
        """The flat groups (buckets, or stage-3 units) and their swap spaces."""
        builder = GroupBuilder(
            model, self.config, self.topology, self.comm, self.zeropp, self.dtype, self._tp_split,
            pool=self.host_memory.pool,
        )  # fmt: skip
        self.groups = builder.build(optimizer)
        self.units, self.frozen_groups = builder.units, builder.frozen_groups
        self._grouped = builder.grouped
        self.swaps = builder.swaps
        """ZeRO-Infinity: this rank's swap spaces (NVMe tiers), removed by `close` or at exit."""
        log_quantization_padding(self.zeropp, self.groups + self.frozen_groups)
        self._cast_other_params()

    def _build_stage3(self) -> None:
        """Stage 3: the coordinator's gather/release hooks and whole-weight state dicts."""
        config = self.config
        self.coordinator: Zero3Coordinator | None = None
        self.state_dict_hooks: StateDictHooks | None = None
        """Stage 3: make ``model.state_dict()``/``load_state_dict()`` gather (collective)."""
        if config.stage != 3:
            return
        read_ahead = config.offload_param_buffer_count if "offload_param" in self.swaps else 0
        self.coordinator = Zero3Coordinator(
            self.units,
            control=self.topology.dp_control,
            prefetch_numel=config.prefetch_bucket_size,
            max_live_numel=config.max_live_parameters,
            check_execution_order=config.check_execution_order,
            read_ahead=read_ahead,
            comm=self.comm,
            max_reuse_numel=config.max_reuse_distance,
        )
        mark_whole_shapes(self.groups + self.frozen_groups)
        self.state_dict_hooks = StateDictHooks(
            self.module, self.units, self.topology.dp_control, self.tp, self.comm
        )
        pretrained_save.route_model_save(self)

    def _build_step(self, optimizer, lr_scheduler) -> None:
        """The loss scaler, the gradient reducer, the sharded optimizer and the counters."""
        config = self.config
        self.loss_scaler = LossScaler.from_config(config)
        self.reducer = GradientReducer(
            self.groups,
            config.stage,
            config.gradient_accumulation_steps,
            config.overlap_comm,
            control=self.topology.dp_control,
            comm=self.comm,
            max_inflight_numel=config.reduce_inflight_numel,
        )
        self.reducer.on_backward_end = self._check_backward
        self.optimizer = ShardedOptimizer(
            optimizer,
            self.groups,
            self.comm,
            self.topology.dp,
            self.loss_scaler,
            tp_group=self.topology.tp if self.tp is not None else None,
            fast_kernel=config.offload_optimizer_fast_kernel,
            buffer_count=config.offload_optimizer_buffer_count,
        )
        self.lr_scheduler = lr_scheduler
        self.global_steps = 0
        """Optimizer steps taken."""
        self.skipped_steps = 0
        """Steps skipped because of fp16 overflow."""
        self._last_step_micro = 0
        self.last_step_skipped = False
        """True when the last boundary step was skipped (fp16 overflow)."""
        self._clipped = False
        self._in_engine_backward = False

    def describe(self) -> str:
        """One line: stage, ranks, precision and what is switched on (printed at start)."""
        return describe(self)

    # --- construction ------------------------------------------------------------------------
    def _apply_tensor_parallel(self, optimizer: torch.optim.Optimizer) -> None:
        """Split the planned modules over the TP group (AutoTP) and re-point the optimizer."""
        if any(true_numel(p) != p.numel() for p in self.module.parameters()):
            raise NotImplementedError(
                "hf_zero AutoTP: a partitioned_init() model holds only data-parallel slices, "
                "which tensor parallelism cannot split again; build the model normally (or load "
                "it with from_pretrained) when tp_size > 1"
            )
        plan = resolve_plan(self.module, self.config.tp_plan)
        if not plan:
            kind = getattr(getattr(self.module, "config", None), "model_type", None)
            raise ValueError(
                f"hf_zero AutoTP: 'tp_size' = {self.topology.tp_size} but the model "
                f"({type(self.module).__name__}, model_type {kind!r}) declares no tp_plan; set "
                "'tp_plan' in the config to a mapping of module regexes to styles or a preset "
                f"({', '.join(PRESETS)})"
            )
        # Every rank must split the same full weights: rank 0's, as DDP starts from.
        with torch.no_grad():
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                self.comm.broadcast(t.data, 0, self.topology.world)
        self.tp = TensorParallel(self.module, plan, self.topology.tp, self.comm)
        self.tp.apply()
        for group in optimizer.param_groups:
            group["params"] = [self.tp.local_of(p) for p in group["params"]]

    def _broadcast_module(self) -> None:
        """Start every data-parallel rank from rank 0's weights and buffers, as DDP does."""
        src = self.topology.dp.ranks[0]
        tensors = list(self.module.parameters()) + list(self.module.buffers())
        # A bitsandbytes base: its scales too (bytes as they are; see hf_zero.numerics.packed).
        tensors += [s for p in self.module.parameters() for s in quant_state_tensors(p).values()]
        with torch.no_grad():
            for t in tensors:
                self.comm.broadcast(t.data, src, self.topology.dp)

    def _tp_split(self, param: torch.Tensor) -> bool:
        return self.tp is not None and self.tp.shard_of(param) is not None

    def _cast_other_params(self) -> None:
        """Cast parameters outside the buckets (frozen ones) to the compute dtype."""
        for p in self.module.parameters():
            if is_packed(p):
                continue  # packed codes, not values
            if id(p) not in self._grouped and p.is_floating_point() and p.dtype != self.dtype:
                p.data = p.data.to(self.dtype)

    # --- the training loop -------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    forward = __call__

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        """Backward of ``loss``, scaled for fp16 and divided by the accumulation steps."""
        scale = self.loss_scaler.scale
        if scale_wrt_gas and self.config.gradient_accumulation_steps > 1:
            scale /= self.config.gradient_accumulation_steps
        if not loss.requires_grad:
            raise RuntimeError(
                "hf_zero: the loss does not require a gradient: no trainable parameter was used "
                "to compute it (is every parameter frozen, or the loss computed under no_grad?)"
            )
        self._in_engine_backward = True
        try:
            (loss * scale if scale != 1.0 else loss).backward()
        finally:
            self._in_engine_backward = False

    def _check_backward(self, synced: bool) -> None:
        if self.loss_scaler.enabled and not self._in_engine_backward:
            raise RuntimeError(
                "hf_zero: with fp16 loss scaling call engine.backward(loss), not loss.backward(), "
                "so that the loss is scaled before backward"
            )

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next ``step()`` will update the parameters."""
        return self.reducer.at_boundary and self._last_step_micro != self.reducer.micro_steps

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip the global gradient norm (across all shards); returns the pre-clip norm.

        Call it between the last ``backward`` of an accumulation window and ``step``. The
        post-clip norm is kept in ``engine.grad_norm_post_clip``.
        """
        self._clipped = True
        return self.optimizer.clip_grad_norm_(max_norm)

    @property
    def grad_norm(self) -> float | None:
        """Pre-clip global gradient norm of the last step that computed one."""
        return self.optimizer.last_grad_norm

    @property
    def grad_norm_post_clip(self) -> float | None:
        return self.optimizer.last_grad_norm_post_clip

    def step(self) -> bool:
        """Update the parameters if an accumulation window is complete; True if updated.

        Off the boundary it does nothing (DeepSpeed's convention), so calling it after every
        micro-batch is fine. Gradients are cleared after the update.
        """
        if not self.is_gradient_accumulation_boundary():
            if self.reducer.micro_steps == 0:
                warnings.warn(
                    "hf_zero: engine.step() before any backward: nothing to update", stacklevel=2
                )
            return False
        self._last_step_micro = self.reducer.micro_steps
        stepped = self.optimizer.step(self.config.gradient_clipping, clipped=self._clipped)
        for group in self.frozen_groups:
            group.release_secondary()  # trainable groups dropped theirs when they were updated
        self.last_step_skipped = not stepped
        if stepped:
            self.global_steps += 1
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        else:
            self.skipped_steps += 1
        self.zero_grad()
        self.host_memory.after_step()
        if self.profiler is not None:
            self.profiler.after_step()
        return stepped

    def train_batch(self, batch: Batch, microbatches: int | None = None) -> float:
        """One optimizer step on ``batch`` (this rank's samples; the model's forward arguments,
        with ``labels``), cut into ``gradient_accumulation_steps`` micro-batches; this rank's
        mean micro-batch loss. The same as the hand-written loop over the micro-batches."""
        steps = self.config.gradient_accumulation_steps
        if microbatches not in (None, steps):
            raise ValueError(
                f"hf_zero: train_batch(microbatches={microbatches}): a ZeroEngine steps every "
                f"'gradient_accumulation_steps' = {steps} micro-batches; leave microbatches "
                "unset or set gradient_accumulation_steps in the config"
            )
        losses = []
        for piece in split_batch(batch, steps, "hf_zero train_batch"):
            loss = loss_of(self(**piece), "hf_zero train_batch")
            self.backward(loss)
            losses.append(loss.detach().float())
        self.step()
        return torch.stack(losses).mean().item()

    @torch.no_grad()
    def eval_batch(self, batch: Batch, microbatches: int | None = None) -> float:
        """This rank's mean micro-batch loss on ``batch`` (one micro-batch unless given)."""
        pieces = split_batch(batch, microbatches or 1, "hf_zero eval_batch")
        losses = [loss_of(self(**p), "hf_zero eval_batch").float() for p in pieces]
        return torch.stack(losses).mean().item()

    def zero_grad(self) -> None:
        for group in self.groups:
            group.zero_grad()
        self.optimizer.end_step()
        self._clipped = False

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient communication for the backward passes inside (stages 0 and 1).

        Stage 2 still reduce-scatters every backward and accumulates the shard, because it
        keeps no full-size gradients to accumulate locally; the result is the same.
        """
        previous = self.reducer.sync_enabled
        self.reducer.sync_enabled = False
        try:
            yield
        finally:
            self.reducer.sync_enabled = previous

    def train(self, mode: bool = True) -> ZeroEngine:
        self.module.train(mode)
        return self

    def eval(self) -> ZeroEngine:
        return self.train(False)

    def parameters(self):
        return self.module.parameters()

    def named_parameters(self):
        return self.module.named_parameters()

    # --- inspection --------------------------------------------------------------------------
    @property
    def comm_stats(self) -> CommStats:
        """Calls, wire and ZeRO-paper bytes per purpose and kind since initialisation (``.reset()``
        to restart); `hf_zero.comm.stats`. ``init_comm_stats`` holds what initialisation sent."""
        return self.comm.stats

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    def close(self) -> None:
        """`Engine.close`, and the gather buffers kept for reuse are freed."""
        super().close()
        self.host_memory.pool.clear()

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds now, by kind: params, grads, master_weights, optimizer_states,
        secondary_params (ZeRO++ hpZ: ``1/hpz`` of each parameter gathered since the last
        step), quantized_params (MixZ++: the INT8 shards and scales of frozen weights) and
        pooled_params (stage 3 on CPU with ``host_memory: unmap``: released gather buffers kept
        for the next gather of their size, `hf_zero.storage.buffer_pool`).

        Counts the tensors themselves (flat buffers, shards, optimizer state), not allocator
        caches, so the figures can be checked against the ZeRO formulas. ``host_grads``,
        ``host_master_weights`` and ``host_optimizer_states`` are what ZeRO-Offload keeps in CPU
        memory instead, ``host_params`` the shards ``offload_param: cpu`` keeps there;
        ``nvme_*`` kinds are swap-file bytes on disk (ZeRO-Infinity), not memory.
        ``total`` sums the device kinds, ``host_total`` the host ones, ``nvme_total`` the disk.
        """
        return held_memory(
            self.groups + self.frozen_groups, self.module, self._grouped, self.optimizer,
            self.host_memory.pool,
        )  # fmt: skip

    def full_state_dict(
        self, rank0_only: bool = True, master_weights: bool = False
    ) -> dict[str, torch.Tensor]:
        """The model's complete state dict on CPU (collective; ``{}`` off rank 0 with
        ``rank0_only``), gathered one group at a time. ``master_weights=True`` gives trainable
        parameters their fp32 master values."""
        return full_state_dict(self, rank0_only, master_weights)

    def saved_state_dict(self, only_trainable: bool = False) -> dict[str, torch.Tensor]:
        """What ``save_model`` writes (collective; ``{}`` off rank 0): each parameter in its
        dtype before training, or the training precision with ``save_16bit_model``;
        ``only_trainable``: an adapter's parameters only, the frozen base never gathered."""
        return saved_state_dict(self, only_trainable=only_trainable)

    def save_pretrained(self, directory: str | Path, is_main_process: bool = True, **kwargs):
        """`saved_state_dict` written as Hugging Face safetensors one group at a time, never
        whole on a rank (collective); see `hf_zero.engine.pretrained_save`."""
        return pretrained_save.save_pretrained(self, directory, is_main_process, **kwargs)

    def save_checkpoint(self, directory: str | Path, keep_last: int | None = None) -> None:
        """Write master shards and optimizer state, one file per rank, atomically (collective).

        ``directory`` is replaced as a whole once every rank has written; ``keep_last`` deletes
        the oldest complete checkpoints next to it beyond that many. See `hf_zero.engine.checkpointing`.
        """
        checkpointing.save_checkpoint(self, directory, keep_last)

    def load_checkpoint(self, directory: str | Path) -> None:
        """Restore what `save_checkpoint` wrote, at any world size and stage (resharded)."""
        checkpointing.load_checkpoint(self, directory)

    def gathered_parameters(self, params=None, modifier_rank: int | None = None):
        """Context in which ``params`` (default: all) are whole; see `gathered_parameters`."""
        return gathered_parameters(
            self.module.parameters() if params is None else params, modifier_rank
        )

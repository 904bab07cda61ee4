"""`PipelineEngine`: a causal LM trained in pipeline stages, one optimizer step per `train_batch`.

Ranks form a ``pp x dp x tp`` grid (`Topology`: pipeline outermost, tensor innermost).
AutoTP splits the model inside every stage (as `ZeroEngine` does), the model is cut into stages
(`split.py`; two virtual stages per rank with ``interleaved_1f1b``), and
`torch.distributed.pipelining` runs the schedule on each pipeline (measured exact on gloo/CPU in
tests/pipeline/test_pipeline.py). `train_batch` cuts the replica's batch into ``pp_microbatches``
along dim 0, runs the schedule, sums the tied embedding's two copies' gradients, averages the
gradients over the stage's data-parallel group, clips the global norm across every stage, steps,
and returns the replica's mean micro-batch loss on every rank of the replica.

Each rank builds the whole model, keeps its stages' parameters and empties the others'. Its
stages' parameters go into the same flat groups, master weights and sharded optimizer as
`ZeroEngine`'s stages 0-2 (`GroupBuilder`, `ShardedOptimizer`), over the stage's data-parallel
group, so what ZeRO offers there (an offloaded optimizer step, 16-bit master weights and
optimizer state, ZeRO++'s quantized gradient reduction) reaches pipelines too.
The one difference is when gradients are reduced: the schedule runs each micro-batch's backward
itself, so they accumulate whole in ``.grad`` and are reduced once after it
(`GradientReducer.reduce_accumulated`); ZeRO-2 then frees them right after the reduce-scatter,
which is what it saves here, as DeepSpeed's reason for refusing ZeRO-2 with pipelines says.
In bf16 or fp16 the stages compute in 16 bits, the micro-batches' gradients add up in the
16-bit ``.grad`` (as DDP accumulates in the parameters' dtype) and the step updates fp32 master
weights, which checkpoints and saved models take their values from; fp16 scales the loss of
each micro-batch inside the schedule (`_scaled_loss`) and skips a step that overflowed anywhere.
16-bit master weights round each step stochastically, bucket by bucket, so the tied weight's two
copies are made equal again after it (`_copy_tied_weight`).
"""

from __future__ import annotations

import contextlib
import sys
import weakref

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from hf_zero.config.zero_config import ZeroConfig
from hf_zero.engine.memory_report import held_memory
from hf_zero.engine.start_up import start_up
from hf_zero.engine.surface import Engine
from hf_zero.numerics.precision import DTYPES, LossScaler
from hf_zero.optim import ShardedOptimizer
from hf_zero.optim.setup import optimizer_and_scheduler
from hf_zero.pipeline.booked_stage import BookedStage
from hf_zero.pipeline.split import (
    CausalLMStage,
    split_causal_lm,
    stage_layer_ranges,
    stage_model_parameters,
    sync_tied_grads,
)
from hf_zero.profiling import profile_settings
from hf_zero.sharding.grouping import GroupBuilder, zeropp_settings
from hf_zero.sharding.reducer import GradientReducer
from hf_zero.sharding.tp import TensorParallel, resolve_plan

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
MAX_SCHEDULES = 16


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The Hugging Face causal-LM loss: next-token cross entropy, ``-100`` ignored, in fp32."""
    flat = logits[:, :-1].float().reshape(-1, logits.shape[-1])
    return torch.nn.functional.cross_entropy(flat, labels[:, 1:].reshape(-1), ignore_index=-100)


def check_supported(config: ZeroConfig) -> None:
    """Refuse what pipeline stages do not combine with, before any process-group work."""
    if config.stage == 3:
        raise NotImplementedError(
            "hf_zero pipeline: 'stage' = 3 with 'pp_size' > 1 is not supported: ZeRO-3 gathers a "
            "layer's parameters for each forward and backward, and a pipeline runs every layer "
            "once per micro-batch, so it would gather each layer 2 x pp_microbatches times per "
            "step (DeepSpeed refuses it too). Use 'stage' 1 or 2, which shard the optimizer "
            "state (and gradients) over each stage's data-parallel group"
        )
    if profile_settings(config) is not None:
        raise NotImplementedError(
            "hf_zero pipeline: profiling ('profile' = true, hf-zero doctor) is not implemented "
            "for pipeline stages yet (a step's phases interleave across micro-batches); profile "
            "the same model with 'pp_size' 1"
        )


class PipelineEngine(Engine):
    """Pipeline stages (x data x tensor parallelism); built by `hf_zero.initialize` when
    ``pp_size`` > 1."""

    is_pipeline = True

    def __init__(self, model, optimizer, config: ZeroConfig, lr_scheduler=None) -> None:
        check_supported(config)
        optimizer, lr_scheduler = optimizer_and_scheduler(model, optimizer, config, lr_scheduler)
        me = weakref.ref(self)
        start = start_up(config, model, lambda: getattr(me(), "global_steps", "?"))
        self.config = config = start.config
        self.topology = topo = start.topology
        self.comm, self.device, self.watchdog = start.comm, start.device, start.watchdog
        self.pp_comm = self.comm.for_purpose("pp")
        """Collectives booked as the pipeline's traffic (`hf_zero.comm.stats`)."""
        self.module, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.dtype = DTYPES[config.precision]
        self.loaded_dtypes = {n: p.dtype for n, p in model.named_parameters()}
        """Each parameter's dtype before training, by name: what a saved model holds."""
        with torch.no_grad():  # every replica starts from rank 0's weights, as DDP does
            for t in list(model.parameters()) + list(model.buffers()):
                self.comm.broadcast(t.data, 0, topo.world)
        self.tp = self._apply_tp() if config.tp_size > 1 else None

        virtual = 2 if config.pp_schedule == "interleaved_1f1b" else 1
        self.num_stages = n_stages = topo.pp_size * virtual
        self.stage_ids = list(range(topo.pp_rank, n_stages, topo.pp_size))  # looped placement
        self.stages: list[CausalLMStage] = [
            split_causal_lm(model, n_stages, s, config.pp_partition) for s in self.stage_ids
        ]
        # Every stage's parameters, for gather_whole_model (a partition by parameter count can
        # no longer be recomputed once the other stages' parameters are emptied).
        self._all_stage_params = [
            stage_model_parameters(model, layers, s == 0, s == n_stages - 1)
            for s, layers in enumerate(stage_layer_ranges(model, n_stages, config.pp_partition))
        ]
        self._release_other_stages()
        for stage in self.stages:
            stage.to(self.device)
        self.tied_copy = self._adopt_tied_copy()
        self.first = any(s.first for s in self.stages)
        self.last = any(s.last for s in self.stages)
        self.microbatches = config.pp_microbatches or (
            config.gradient_accumulation_steps if config.gradient_accumulation_steps > 1 else
            topo.pp_size
        )  # fmt: skip
        self._schedules: dict[tuple, object] = {}
        """Schedules by micro-batch shape: a stage sizes its receive buffers from the first
        micro-batch it sees, so another shape (a new sequence length) gets its own."""
        self.tied = self.stages[0].tied
        self._build_step(optimizer)
        self.global_steps = 0
        self.skipped_steps = 0
        """Steps skipped because of fp16 overflow."""
        self.last_step_skipped = False
        self.last_grad_norm: float | None = None
        self.grad_norm_post_clip: float | None = None
        if dist.get_rank() == 0:  # one start line, as the ZeRO engine prints
            print(
                f"hf_zero: pipeline of {topo.pp_size} stages ({config.pp_schedule}) x "
                f"{topo.dp_size} data-parallel (ZeRO stage {config.stage}) x {topo.tp_size} "
                "tensor-parallel ranks",
                file=sys.stderr,
                flush=True,
            )

    def _apply_tp(self) -> TensorParallel:
        plan = resolve_plan(self.module, self.config.tp_plan)
        if not plan:
            raise ValueError(
                f"hf_zero AutoTP: 'tp_size' = {self.config.tp_size} but "
                f"{type(self.module).__name__} declares no tp_plan; set 'tp_plan' in the config"
            )
        tp = TensorParallel(self.module, plan, self.topology.tp, self.comm)
        tp.apply()
        for group in self.optimizer.param_groups:
            group["params"] = [tp.local_of(p) for p in group["params"]]
        return tp

    def _release_other_stages(self) -> None:
        """Empty the parameters no stage of this rank runs (the optimizer skips them)."""
        mine = {id(p) for s in self.stages for p in s.parameters()}
        self._released = {}  # id -> (parameter, its shape): what gather_whole_model refills
        for p in self.module.parameters():
            if id(p) not in mine:
                self._released[id(p)] = (p, p.shape)
                p.data = torch.empty(0, dtype=p.dtype)

    @torch.no_grad()
    def gather_whole_model(self) -> None:
        """Give this rank's module every stage's current weights again (collective over each
        pipeline), so that ``model(...)`` runs on every rank after training, as it did
        before; the memory of the whole model comes back with it. Training may continue."""
        topo = self.topology
        for s, params in enumerate(self._all_stage_params):
            owner = topo.rank_of(s % topo.pp_size, topo.dp_rank, topo.tp_rank)
            for p in params:
                if id(p) in self._released:
                    shape = self._released.pop(id(p))[1]
                    dtype = self.dtype if p.is_floating_point() else p.dtype  # as trained
                    p.data = torch.empty(shape, dtype=dtype, device=self.device)
                self.pp_comm.broadcast(p.data, owner, topo.pp)

    def _adopt_tied_copy(self) -> torch.nn.Parameter | None:
        """The last stage's copy of a tied weight steps with the embedding's param group."""
        for stage in self.stages:
            if stage.last and stage.tied and not stage.first:
                embed = self.module.get_input_embeddings().weight
                for group in self.optimizer.param_groups:
                    if any(p is embed for p in group["params"]):
                        group["params"].append(stage.lm_head.weight)
                return stage.lm_head.weight
        return None

    def _build_step(self, optimizer: torch.optim.Optimizer) -> None:
        """This rank's stages in flat groups over the stage's data-parallel group (ZeRO stage
        0-2, as `ZeroEngine` builds them), the reducer that takes their gradients after the
        schedule, and the optimizer re-pointed at their master weights."""
        config, topo = self.config, self.topology
        mine = {id(p) for p in self.stage_parameters()}
        for group in optimizer.param_groups:  # the emptied stages' parameters leave it
            group["params"] = [p for p in group["params"] if id(p) in mine]
        builder = GroupBuilder(
            torch.nn.ModuleList(self.stages), config, topo, self.comm, zeropp_settings(config, topo),
            self.dtype, lambda p: self.tp is not None and self.tp.shard_of(p) is not None,
            # The first stage's embedding counts the tied weight's gradient; its copy does not.
            counted_in_norm=lambda p: p is not self.tied_copy,
        )  # fmt: skip
        self.groups = builder.build(optimizer)
        self._grouped, self.swaps = builder.grouped, builder.swaps
        # 16-bit masters (`CompactMaster`) round each copy of the tied weight with its own
        # group's noise, so the first stage sends its values after each step. Read from the
        # config, not the groups, so that both ranks of the pair agree.
        self._resync_tied = (
            self.tied and self.num_stages > 1 and (self.first or self.last)
            and config.master_weights_dtype == "bf16"
        )  # fmt: skip
        for p in self.stage_parameters():  # frozen ones compute in the training precision too
            if id(p) not in self._grouped and p.is_floating_point() and p.dtype != self.dtype:
                p.data = p.data.to(self.dtype)
        self.reducer = GradientReducer(
            self.groups, config.stage, 1, overlap_comm=True, control=topo.dp_control,
            comm=self.comm, max_inflight_numel=config.reduce_inflight_numel, hooks=False,
        )  # fmt: skip
        self.loss_scaler = LossScaler.from_config(config)
        self.optimizer = ShardedOptimizer(
            optimizer, self.groups, self.comm, topo.dp, self.loss_scaler,
            tp_group=topo.tp if self.tp is not None else None,
            fast_kernel=config.offload_optimizer_fast_kernel,
            buffer_count=config.offload_optimizer_buffer_count, pp_group=topo.pp,
        )  # fmt: skip

    def stage_parameters(self) -> list[torch.nn.Parameter]:
        """This rank's parameters, every stage of it, in order (a tied copy included)."""
        return list(dict.fromkeys(p for s in self.stages for p in s.parameters()))

    # --- training --------------------------------------------------------------------------
    def train_batch(self, batch: dict[str, torch.Tensor], microbatches: int | None = None) -> float:
        """One optimizer step on ``batch`` (this replica's samples: ``input_ids``, optional
        ``attention_mask`` and ``labels``), cut into ``microbatches`` (default
        ``pp_microbatches``); the replica's mean micro-batch loss, on every rank of the
        replica."""
        loss = self._run(batch, microbatches or self.microbatches, training=True)
        if self.tied and self.num_stages > 1:
            tied = self.topology.tied
            for stage in self.stages:
                if stage.first or stage.last:
                    sync_tied_grads(stage, tied.pg, lambda g: self.pp_comm.all_reduce(g, tied))
        self.reducer.reduce_accumulated()
        self.clip_grad_norm_(self.config.gradient_clipping or float("inf"))
        stepped = self.optimizer.step(clipped=True)
        for group in self.groups:
            group.zero_grad()
        self.optimizer.end_step()
        self.last_step_skipped = not stepped
        if stepped:
            if self._resync_tied:
                self._copy_tied_weight()
            self.global_steps += 1
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
        else:
            self.skipped_steps += 1
        return loss

    @torch.no_grad()
    def _copy_tied_weight(self) -> None:
        """Give the last stage's copy of the tied weight the first stage's stepped values
        (collective over the pair): both took the same update, rounded apart."""
        weight = self.tied_copy
        if weight is None:
            weight = self.module.get_input_embeddings().weight
        self.pp_comm.broadcast(weight.data, self.topology.tied.ranks[0], self.topology.tied)

    @property
    def loss_scale(self) -> float:
        """The fp16 loss scale now (1.0 without fp16)."""
        return self.loss_scaler.scale

    def _scaled_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The schedule's loss: `lm_loss` times the loss scale now (fp16; else 1), so that each
        micro-batch's backward inside the schedule starts from the scaled loss."""
        loss = lm_loss(logits, labels)
        return loss * self.loss_scaler.scale if self.loss_scaler.enabled else loss

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Nothing is reduced between `train_batch` calls: a loop's no-sync window is free."""
        return contextlib.nullcontext()

    @torch.no_grad()
    def eval_batch(self, batch: dict[str, torch.Tensor], microbatches: int | None = None) -> float:
        """The replica's mean micro-batch loss on ``batch``, without a step."""
        return self._run(batch, microbatches or self.microbatches, training=False)

    def schedule_for(self, shape: tuple):
        """The schedule for ``shape`` = (micro-batches, micro-batch shape...) (built on first
        use; collective over this rank's pipeline, which sees the same batches)."""
        if shape not in self._schedules:
            if len(self._schedules) >= MAX_SCHEDULES:  # the oldest shape goes
                self._schedules.pop(next(iter(self._schedules)))
            pipes = [
                BookedStage(m, s, self.num_stages, self.device, self.topology.pp, self.pp_comm)
                for m, s in zip(self.stages, self.stage_ids)
            ]
            count = shape[0]
            if len(pipes) > 1:
                schedule = ScheduleInterleaved1F1B(pipes, count, loss_fn=self._scaled_loss)
            else:
                # 1F1B needs at least one micro-batch per stage; a shorter window (the end of
                # an epoch under the Trainer) runs GPipe, which computes the same step.
                name = self.config.pp_schedule if count >= self.topology.pp_size else "gpipe"
                schedule = SCHEDULES[name](pipes[0], count, loss_fn=self._scaled_loss)
            self._schedules[shape] = schedule
        return self._schedules[shape]

    def _run(self, batch: dict[str, torch.Tensor], microbatches: int, training: bool) -> float:
        ids = batch["input_ids"].to(self.device).contiguous()
        labels = batch.get("labels", ids).to(self.device).contiguous()
        mask = batch.get("attention_mask")
        if ids.shape[0] % microbatches:
            raise ValueError(
                f"hf_zero pipeline: a batch of {ids.shape[0]} samples does not split into "
                f"{microbatches} micro-batches ('pp_microbatches')"
            )
        shape = (microbatches, ids.shape[0] // microbatches, *ids.shape[1:], mask is not None)
        schedule = self.schedule_for(shape)
        run = schedule.step if training else schedule.eval
        losses: list[torch.Tensor] = []
        target = labels if self.last else None
        if self.first:
            kwargs = {} if mask is None else {"attention_mask": mask.to(self.device).contiguous()}
            run(ids, target=target, losses=losses, **kwargs)
        else:
            run(target=target, losses=losses)
        mean = torch.zeros(1, device=self.device)
        if self.last:
            mean += torch.stack([x.detach().float() for x in losses]).mean() / self.loss_scale
        topo = self.topology
        src = topo.rank_of(topo.pp_size - 1, topo.dp_rank, topo.tp_rank)
        dist.broadcast(mean, src, group=topo.pp.pg)
        return mean.item()

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip the global gradient norm over every stage, replica and TP slice (a tied weight
        counted once); returns the norm before clipping. Call after the reduction."""
        norm = self.optimizer.clip_grad_norm_(max_norm)
        self.last_grad_norm = norm
        self.grad_norm_post_clip = self.optimizer.last_grad_norm_post_clip
        return norm

    # --- reports ---------------------------------------------------------------------------
    @property
    def comm_stats(self):
        """Bytes moved by hf_zero's collectives on this rank (the stages' point-to-point
        activations are `torch.distributed.pipelining`'s and not counted)."""
        return self.comm.stats

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds now, by kind, as `ZeroEngine.memory_report` counts them: its
        stages' parameters, gradients, master weights and optimizer state (``host_*``,
        ``nvme_*``: offloaded)."""
        return held_memory(self.groups, self.module, self._grouped, self.optimizer)

    # --- weights and checkpoints -----------------------------------------------------------
    def _stage_values(self, master_weights: bool) -> dict[int, torch.Tensor]:
        """This rank's parameters' values (TP slices) by id, on the device; ``master_weights``:
        trainable ones from their fp32 master weights (collective over the stage's replicas)."""
        values = {id(p): p.detach() for p in self.stage_parameters()}
        if master_weights:
            for group in self.groups:
                full = group.full_master()
                for slot, p in zip(group.layout.slots, group.params):
                    values[id(p)] = full[slot.offset : slot.end].view(slot.shape)
        return values

    def saved_state_dict(self) -> dict[str, torch.Tensor]:
        """What a saved model holds (collective; ``{}`` off rank 0), as `ZeroEngine` saves it:
        each parameter in its dtype before training, trainable ones from their fp32 master
        weights; with ``save_16bit_model`` the parameters as trained."""
        if self.config.save_16bit_model:
            return self.full_state_dict()
        full = self.full_state_dict(master_weights=True)
        return {n: t.to(self.loaded_dtypes.get(n, t.dtype)) for n, t in full.items()}

    def full_state_dict(self, master_weights: bool = False) -> dict[str, torch.Tensor]:
        """The whole model's parameters with their Hugging Face names on rank 0 (``{}``
        elsewhere; collective), as trained or (``master_weights``) from the fp32 masters."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        values = self._stage_values(master_weights)
        if self.tp is not None:
            for p in self.stage_parameters():
                shard = self.tp.shard_of(p)
                if shard is not None and id(p) in names:
                    values[id(p)] = self.tp.gather_full(values[id(p)], shard)
        mine = {}
        if self.topology.dp_rank == 0 and self.topology.tp_rank == 0:
            mine = {
                names[id(p)]: values[id(p)].to("cpu", copy=True)
                for p in self.stage_parameters()
                if id(p) in names
            }
        parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, parts, dst=0)
        if dist.get_rank() != 0:
            return {}
        full = {}
        for part in parts:
            full.update(part)
        return full

    def save_checkpoint(self, directory, keep_last: int | None = None) -> None:
        """Write a per-stage checkpoint atomically (collective); see `pipeline.checkpoint`."""
        from hf_zero.engine.pipeline_checkpointing import save_checkpoint

        save_checkpoint(self, directory, keep_last)

    def load_checkpoint(self, directory) -> None:
        """Resume from `save_checkpoint`'s directory, at this or another pp/dp layout."""
        from hf_zero.engine.pipeline_checkpointing import load_checkpoint

        load_checkpoint(self, directory)

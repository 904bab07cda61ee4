"""`PipelineEngine`: a causal LM trained in pipeline stages, one optimizer step per `train_batch`.

First part of issue 19: every process is one pipeline stage (``pp_size`` = world size; two
virtual stages per rank with ``interleaved_1f1b``), without data or tensor parallelism and with
plain (unsharded) optimizer state per stage. `train_batch` cuts the batch into
``pp_microbatches`` along dim 0, runs the schedule (`torch.distributed.pipelining`, measured exact
on gloo/CPU in tests/test_pipeline.py), sums the tied embedding's two copies' gradients, clips the
global norm across all stages, steps the user's optimizer and returns the mean micro-batch loss on
every rank.

Each rank builds the whole model, keeps its stages' parameters and empties the others' (they get
no gradient, so the optimizer skips them and never holds state for them).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from hf_zero.config import ZeroConfig
from hf_zero.pipeline.split import CausalLMStage, split_causal_lm, sync_tied_grads
from hf_zero.topology import current_device, init_distributed

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The Hugging Face causal-LM loss: next-token cross entropy, ``-100`` ignored, in fp32."""
    flat = logits[:, :-1].float().reshape(-1, logits.shape[-1])
    return torch.nn.functional.cross_entropy(flat, labels[:, 1:].reshape(-1), ignore_index=-100)


class PipelineEngine:
    """Pipeline stages over all processes; built by `hf_zero.initialize` when ``pp_size`` > 1."""

    def __init__(self, model, optimizer, config: ZeroConfig, lr_scheduler=None) -> None:
        init_distributed()
        world, rank = dist.get_world_size(), dist.get_rank()
        pp = config.pp_size
        if pp != world or config.tp_size != 1:
            raise NotImplementedError(
                f"hf_zero pipeline: 'pp_size' = {pp} on {world} processes (tp_size "
                f"{config.tp_size}): data and tensor parallelism alongside pipeline stages are "
                "not implemented yet (issue 19); run pp_size = the number of processes"
            )
        if config.stage != 0 or config.offload_optimizer != "none":
            raise NotImplementedError(
                f"hf_zero pipeline: 'stage' = {config.stage} with pipeline stages is not "
                "implemented yet (issue 19); each stage keeps its own optimizer state (stage 0)"
            )
        if optimizer is None:
            raise ValueError("hf_zero pipeline: pass an optimizer built on model.parameters()")
        self.config, self.module, self.optimizer = config, model, optimizer
        self.lr_scheduler = lr_scheduler
        self.device = current_device()
        self.topology = SimpleNamespace(
            pp_rank=rank, dp_rank=0, tp_rank=0, pp_size=pp, dp_size=1, tp_size=1, rank=rank
        )
        virtual = 2 if config.pp_schedule == "interleaved_1f1b" else 1
        n_stages = pp * virtual
        self.stages: list[CausalLMStage] = [
            split_causal_lm(model, n_stages, s, config.pp_partition)
            for s in range(rank, n_stages, pp)  # looped placement: rank r runs r, r + pp, ...
        ]
        self._release_other_stages()
        for stage in self.stages:
            stage.to(self.device)
        self._adopt_tied_copy()
        self.first = any(s.first for s in self.stages)
        self.last = any(s.last for s in self.stages)
        self.last_rank = (n_stages - 1) % pp
        self.microbatches = config.pp_microbatches or (
            config.gradient_accumulation_steps if config.gradient_accumulation_steps > 1 else pp
        )
        pipes = [
            PipelineStage(m, s, n_stages, self.device)
            for m, s in zip(self.stages, range(rank, n_stages, pp))
        ]
        if virtual > 1:
            self.schedule = ScheduleInterleaved1F1B(pipes, self.microbatches, loss_fn=lm_loss)
        else:
            cls = SCHEDULES[config.pp_schedule]
            self.schedule = cls(pipes[0], self.microbatches, loss_fn=lm_loss)
        tied = self.stages[0].tied and n_stages > 1
        self._tied_group = dist.new_group([0, self.last_rank]) if tied else None
        self.global_steps = 0
        self.last_grad_norm: float | None = None

    def _release_other_stages(self) -> None:
        """Empty the parameters no stage of this rank runs (the optimizer skips them)."""
        mine = {id(p) for s in self.stages for p in s.parameters()}
        for p in self.module.parameters():
            if id(p) not in mine:
                p.data = torch.empty(0, dtype=p.dtype)

    def _adopt_tied_copy(self) -> None:
        """The last stage's copy of a tied weight steps with the embedding's param group."""
        for stage in self.stages:
            if stage.last and stage.tied and not stage.first:
                embed = self.module.get_input_embeddings().weight
                for group in self.optimizer.param_groups:
                    if any(p is embed for p in group["params"]):
                        group["params"].append(stage.lm_head.weight)

    # --- training --------------------------------------------------------------------------
    def train_batch(self, batch: dict[str, torch.Tensor]) -> float:
        """One optimizer step on ``batch`` (this replica's samples: ``input_ids``, optional
        ``attention_mask`` and ``labels``); the mean micro-batch loss, on every rank."""
        losses = self._run(batch, self.schedule.step)
        if self._tied_group is not None:
            for stage in self.stages:
                if stage.first or stage.last:
                    sync_tied_grads(stage, self._tied_group)
        if self.config.gradient_clipping > 0:
            self.clip_grad_norm_(self.config.gradient_clipping)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.global_steps += 1
        return losses

    @torch.no_grad()
    def eval_batch(self, batch: dict[str, torch.Tensor]) -> float:
        """The mean micro-batch loss of ``batch`` without a step."""
        return self._run(batch, self.schedule.eval)

    def _run(self, batch: dict[str, torch.Tensor], run) -> float:
        ids = batch["input_ids"].to(self.device)
        labels = batch.get("labels", ids).to(self.device)
        mask = batch.get("attention_mask")
        if ids.shape[0] % self.microbatches:
            raise ValueError(
                f"hf_zero pipeline: a batch of {ids.shape[0]} samples does not split into "
                f"'pp_microbatches' = {self.microbatches}"
            )
        losses: list[torch.Tensor] = []
        target = labels if self.last else None
        if self.first:
            kwargs = {} if mask is None else {"attention_mask": mask.to(self.device)}
            run(ids, target=target, losses=losses, **kwargs)
        else:
            run(target=target, losses=losses)
        mean = torch.zeros(1, device=self.device)
        if self.last:
            mean += torch.stack([x.detach().float() for x in losses]).mean()
        dist.broadcast(mean, self.last_rank)
        return mean.item()

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip the global gradient norm over every stage (a tied weight counted once); returns
        the norm before clipping."""
        own = [p for s in self.stages for p in self._unique(s) if p.grad is not None]
        sq = torch.zeros(1, device=self.device)
        for p in own:
            sq += p.grad.float().pow(2).sum()
        dist.all_reduce(sq)
        norm = math.sqrt(sq.item())
        coef = max_norm / (norm + 1e-6)  # torch.nn.utils.clip_grad_norm_'s rule
        if coef < 1.0:
            for s in self.stages:
                for p in s.parameters():
                    if p.grad is not None:
                        p.grad.mul_(coef)
        self.last_grad_norm = norm
        return norm

    @staticmethod
    def _unique(stage: CausalLMStage):
        copy = stage.lm_head.weight if stage.last and stage.tied and not stage.first else None
        return [p for p in stage.parameters() if p is not copy]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict with its Hugging Face names on rank 0 (``{}`` elsewhere;
        collective)."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        mine = {
            names[id(p)]: p.detach().to("cpu", copy=True)
            for s in self.stages
            for p in s.parameters()
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

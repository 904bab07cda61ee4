"""A pipeline stage's gradients averaged over its data-parallel group, and its optimizer step.

After the schedule has run every micro-batch, each stage holds its replica's accumulated
gradients. `StageOptimizer` lays each optimizer param group's parameters (this rank's stages
only) end to end in a flat buffer (`FlatLayout`, one shard per data-parallel rank) and:

- ``stage`` 0: all-reduces the flat gradients and hands them back; the user's optimizer steps
  every parameter whole (DeepSpeed's pipeline engine without ZeRO).
- ``stage`` 1: all-reduces them and keeps this rank's shard; the optimizer steps an fp32 master
  shard, so its state is ``1/dp`` of the stage's; the updated shards are all-gathered.
- ``stage`` 2: as stage 1, but reduce-scatters, so the step's gradient is only the shard.

Gradients are accumulated whole across the micro-batches of a step (the schedule runs each
micro-batch's backward separately): ZeRO-2 frees them right after the reduce-scatter, which is
what it saves here, as DeepSpeed's reason for refusing ZeRO-2 with pipelines says.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_zero.comm import Collectives
from hf_zero.comm.topology import Group
from hf_zero.sharding.layout import FlatLayout


@dataclass
class _Flat:
    """One optimizer param group's parameters on this rank, laid out flat."""

    params: list[torch.nn.Parameter]
    layout: FlatLayout
    norm_weights: list[float]
    """Per parameter: 1 counts its gradient in the global norm, 0 does not (a tied copy; a
    TP-replicated parameter on TP ranks other than 0)."""
    master: torch.nn.Parameter | None = None
    """ZeRO-1/2: this rank's fp32 shard, the tensor the optimizer steps."""
    grad: torch.Tensor | None = None
    """Stage 0: the averaged flat gradient between `reduce` and `step`."""


class StageOptimizer:
    """Averages gradients over ``dp`` and steps ``optimizer`` (see the module docstring)."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        optimizer: torch.optim.Optimizer,
        stage: int,
        dp: Group,
        rank: int,
        comm: Collectives,
        norm_weight,
    ) -> None:
        self.optimizer, self.stage, self.dp, self.comm = optimizer, stage, dp, comm
        self.dp_index = dp.rank_of(rank)
        mine = {id(p) for p in params}
        self.flats: list[_Flat | None] = []
        for group in optimizer.param_groups:
            members = [
                p for p in params if p.requires_grad and any(p is q for q in group["params"])
            ]
            members = [p for p in members if id(p) in mine]
            if not members:
                self.flats.append(None)
                continue
            layout = FlatLayout(
                [str(i) for i in range(len(members))], [p.shape for p in members], dp.size
            )
            flat = _Flat(members, layout, [norm_weight(p) for p in members])
            if stage >= 1:
                flat.master = torch.nn.Parameter(torch.empty(0))
            self.flats.append(flat)
        self.copy_params_to_master()
        if stage >= 1:  # the optimizer now steps the shards (its state is 1/dp of the stage's)
            for group, flat in zip(optimizer.param_groups, self.flats):
                group["params"] = [flat.master] if flat is not None else []
            optimizer.state.clear()

    @torch.no_grad()
    def copy_params_to_master(self) -> None:
        """ZeRO-1/2: (re)take this rank's fp32 master shards from the parameters (at start, and
        after a checkpoint wrote new values into them)."""
        for flat in self._flats():
            if flat.master is not None:
                start, end = flat.layout.shard_range(self.dp_index)
                whole = self.flatten([p.data for p in flat.params], flat.layout)
                flat.master.data = whole[start:end].clone()

    @staticmethod
    def flatten(tensors: list[torch.Tensor | None], layout: FlatLayout) -> torch.Tensor:
        """``tensors`` (one per slot, ``None`` for zeros) laid out in an fp32 flat buffer."""
        flat = torch.zeros(layout.padded_numel, dtype=torch.float32, device=_device(tensors))
        for slot, t in zip(layout.slots, tensors):
            if t is not None:
                flat[slot.offset : slot.end] = t.detach().reshape(-1)
        return flat

    def reduce(self) -> None:
        """Average the stage's gradients over the data-parallel group (stage 0: whole; 1-2:
        this rank's shard) and free the parameters' own gradients (ZeRO-1/2)."""
        for flat in self._flats():
            full = self.flatten([p.grad for p in flat.params], flat.layout)
            if self.stage == 2:
                shard = torch.empty(flat.layout.shard_numel, device=full.device)
                self.comm.reduce_scatter(shard, full, self.dp)
            else:
                self.comm.all_reduce(full, self.dp)
                start, end = flat.layout.shard_range(self.dp_index)
                shard = full[start:end].clone() if self.stage == 1 else full
            shard.div_(self.dp.size)
            if self.stage == 0:
                flat.grad = shard
                for slot, p in zip(flat.layout.slots, flat.params):
                    p.grad = shard[slot.offset : slot.end].view(slot.shape).to(p.dtype)
            else:
                flat.master.grad = shard
                for p in flat.params:
                    p.grad = None

    def grad_norm_sq(self) -> torch.Tensor:
        """This rank's part of the squared global norm: summed over all ranks, it counts every
        gradient element of the model once."""
        total = torch.zeros((), dtype=torch.float32)
        for flat in self._flats():
            if self.stage == 0:
                if self.dp_index != 0:
                    continue  # every replica holds the same averaged gradients
                for slot, w in zip(flat.layout.slots, flat.norm_weights):
                    if w:
                        total += flat.grad[slot.offset : slot.end].float().pow(2).sum().cpu()
                continue
            for piece in flat.layout.shard_pieces(self.dp_index):
                if flat.norm_weights[int(piece.slot.name)]:
                    g = flat.master.grad[piece.shard_start : piece.shard_start + piece.numel]
                    total += g.float().pow(2).sum().cpu()
        return total

    def scale_grads(self, coef: float) -> None:
        for flat in self._flats():
            if self.stage == 0:
                for p in flat.params:
                    p.grad.mul_(coef)
            else:
                flat.master.grad.mul_(coef)

    def step(self) -> None:
        """Step the optimizer; ZeRO-1/2: all-gather the updated shards into the parameters."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for flat in self._flats():
            if self.stage == 0:
                for p in flat.params:
                    p.grad = None
                flat.grad = None
                continue
            full = torch.empty(flat.layout.padded_numel, device=flat.master.device)
            self.comm.all_gather(full, flat.master.data, self.dp)
            with torch.no_grad():
                for slot, p in zip(flat.layout.slots, flat.params):
                    p.copy_(full[slot.offset : slot.end].view(slot.shape))

    def state_bytes(self) -> int:
        """Bytes of optimizer state tensors this rank holds, step counters aside (the ZeRO-1/2
        saving is measured on it)."""
        return sum(
            t.numel() * t.element_size()
            for state in self.optimizer.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        )

    def _flats(self) -> list[_Flat]:
        return [f for f in self.flats if f is not None]


def _device(tensors) -> torch.device:
    for t in tensors:
        if t is not None:
            return t.device
    return torch.device("cpu")

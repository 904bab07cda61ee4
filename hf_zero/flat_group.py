"""`FlatParamGroup`: one bucket of parameters and everything it owns for ZeRO stages 0-2.

A group lays its parameters end to end in one padded flat buffer (``flat_param``); each
parameter's ``.data`` becomes a view into it, so the all-gather after the optimizer step writes
straight into the model. The group also owns its gradient storage, its fp32 master-weight shard
and the in-flight reduction, so the engine only has to say *when* to reduce or gather.

What each stage keeps per rank (``N`` ranks, ``S = padded_numel / N``):

=======  ===========================  =============================  =====================
stage    gradients                    reduction                      master weights (fp32)
=======  ===========================  =============================  =====================
0        full ``flat_grad``           all-reduce at the boundary     whole buffer
1        full ``flat_grad``           reduce-scatter at boundary     shard of ``S``
2        fp32 shard of ``S`` only     reduce-scatter every backward  shard of ``S``
=======  ===========================  =============================  =====================
"""

from __future__ import annotations

import torch

from hf_zero.comm import Collectives
from hf_zero.partition import FlatLayout
from hf_zero.topology import Group


class FlatParamGroup:
    """A bucket of same-dtype parameters from one optimizer param group."""

    def __init__(
        self,
        index: int,
        param_group_index: int,
        names: list[str],
        params: list[torch.nn.Parameter],
        stage: int,
        dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        shard_group: Group,
        rank: int,
        comm: Collectives,
    ) -> None:
        self.index = index
        self.param_group_index = param_group_index
        self.params = params
        self.stage = stage
        self.dtype = dtype
        self.reduce_dtype = reduce_dtype
        self.comm = comm
        # Stage 0 does not partition the optimizer: one "shard" covering the whole buffer.
        self.shard_group = shard_group
        num_shards = shard_group.size if stage >= 1 else 1
        self.shard_index = shard_group.rank_of(rank) if stage >= 1 else 0
        self.layout = FlatLayout(names, [p.shape for p in params], num_shards)
        device = params[0].device

        # fp32 master weights come from the parameters' original values, before any cast to
        # 16 bits, so mixed precision loses nothing at initialisation.
        full32 = torch.zeros(self.layout.padded_numel, dtype=torch.float32, device=device)
        for slot, p in zip(self.layout.slots, params):
            full32[slot.offset : slot.end].copy_(p.detach().reshape(-1))
        start, end = self.layout.shard_range(self.shard_index)
        self.flat_param = full32 if dtype == torch.float32 else full32.to(dtype)
        # Stage 0 in fp32 steps the parameters in place: no separate copy is needed.
        self.master_is_flat_param = stage == 0 and dtype == torch.float32
        master = self.flat_param if self.master_is_flat_param else full32[start:end].clone()
        self.master = torch.nn.Parameter(master, requires_grad=False)
        del full32
        self._views = []
        for slot, p in zip(self.layout.slots, params):
            view = self.flat_param[slot.offset : slot.end].view(slot.shape)
            p.data = view
            self._views.append(view)

        # Stages 0-1 keep full gradients in one flat buffer, as views autograd accumulates into.
        self.flat_grad: torch.Tensor | None = None
        self._grad_views: list[torch.Tensor] = []
        if stage < 2:
            self.flat_grad = torch.zeros(self.layout.padded_numel, dtype=dtype, device=device)
            for slot, p in zip(self.layout.slots, params):
                view = self.flat_grad[slot.offset : slot.end].view(slot.shape)
                p.grad = view
                self._grad_views.append(view)

        # Per-backward state.
        self._ready = [False] * len(params)
        self.num_ready = 0
        self.launched = False
        self._reduce_input: torch.Tensor | None = None  # stage 2: this backward's full gradients
        self._reduce_output: torch.Tensor | None = None
        self._work = None

    # --- backward ----------------------------------------------------------------------------
    @property
    def all_ready(self) -> bool:
        return self.num_ready == len(self.params)

    def on_grad_ready(self, i: int) -> None:
        """Take parameter ``i``'s freshly accumulated gradient into the group's storage."""
        p = self.params[i]
        if self.launched:
            raise RuntimeError(
                f"hf_zero: parameter '{self.layout.slots[i].name}' received a gradient after its "
                "bucket was already reduced in this backward pass (the parameter is used again "
                "late in backward, e.g. by reentrant activation checkpointing). Set "
                "'overlap_comm': false to reduce only when backward has finished."
            )
        if self.stage < 2:
            view = self._grad_views[i]
            if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                # Someone reset .grad (e.g. model.zero_grad()); autograd made a fresh tensor.
                view.copy_(p.grad)
                p.grad = view
        else:
            if self._reduce_input is None:
                self._reduce_input = self._new_zeros(self.layout.padded_numel, self.reduce_dtype)
            slot = self.layout.slots[i]
            self._reduce_input[slot.offset : slot.end].add_(p.grad.reshape(-1))
            p.grad = None  # stage 2 never keeps a full gradient beyond its bucket
        if not self._ready[i]:
            self._ready[i] = True
            self.num_ready += 1

    def launch_reduce(self, async_op: bool) -> None:
        """Start this bucket's gradient reduction (all-reduce for stage 0, else reduce-scatter)."""
        self.launched = True
        group = self.shard_group
        if self.stage == 0:
            self._reduce_output = self._as_reduce_dtype(self.flat_grad)
            self._work = self.comm.all_reduce(self._reduce_output, group, async_op=async_op)
            return
        if self.stage == 1:
            self._reduce_input = self._as_reduce_dtype(self.flat_grad)
        elif self._reduce_input is None:
            # No gradient reached this bucket on this rank; other ranks may have some.
            self._reduce_input = self._new_zeros(self.layout.padded_numel, self.reduce_dtype)
        self._reduce_output = self._new_zeros(self.layout.shard_numel, self.reduce_dtype)
        self._work = self.comm.reduce_scatter(
            self._reduce_output, self._reduce_input, group, async_op=async_op
        )

    def finish_reduce(self) -> None:
        """Wait for the reduction and fold the averaged shard into ``master.grad`` (fp32)."""
        if self._work is not None:
            self._work.wait()
        world = self.shard_group.size
        reduced = self._reduce_output
        if self.stage == 0 and self.master_is_flat_param:
            reduced.div_(world)
            self.master.grad = reduced
        else:
            grad = reduced.to(torch.float32).div_(world)
            if self.stage == 2 and self.master.grad is not None:
                self.master.grad.add_(grad)  # accumulate across micro-batches
            else:
                self.master.grad = grad
        self._work = self._reduce_input = self._reduce_output = None
        self._ready = [False] * len(self.params)
        self.num_ready = 0
        self.launched = False

    def reset_backward(self) -> None:
        """Forget readiness after a backward that did not reduce (stages 0-1 inside no_sync)."""
        self._ready = [False] * len(self.params)
        self.num_ready = 0

    # --- after the optimizer step ------------------------------------------------------------
    def gather_params(self, async_op: bool):
        """Write the updated master shard back into every rank's ``flat_param``."""
        if self.master_is_flat_param:
            return None
        if self.stage == 0:
            self.flat_param.copy_(self.master.detach())
            return None
        shard = self.master.detach().to(self.dtype)
        return self.comm.all_gather(self.flat_param, shard, self.shard_group, async_op=async_op)

    def zero_grad(self) -> None:
        self.master.grad = None
        if self.flat_grad is not None:
            self.flat_grad.zero_()
            for p, view in zip(self.params, self._grad_views):
                p.grad = view
        else:
            for p in self.params:
                p.grad = None

    # --- inspection --------------------------------------------------------------------------
    def held_bytes(self) -> dict[str, int]:
        """Bytes this group holds now, by kind (parameters, gradients, master weights)."""
        grads = 0
        if self.flat_grad is not None:
            grads += _nbytes(self.flat_grad)
        if self.master.grad is not None and not self.master_is_flat_param:
            grads += _nbytes(self.master.grad)
        return {
            "params": _nbytes(self.flat_param),
            "grads": grads,
            "master_weights": 0 if self.master_is_flat_param else _nbytes(self.master),
        }

    def full_master(self) -> torch.Tensor:
        """The whole fp32 master buffer, gathered across the shard group (collective)."""
        if self.layout.num_shards == 1:
            return self.master.detach().float()
        full = self._new_zeros(self.layout.padded_numel, torch.float32)
        self.comm.all_gather(full, self.master.detach(), self.shard_group)
        return full

    def _as_reduce_dtype(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.dtype == self.reduce_dtype else t.to(self.reduce_dtype)

    def _new_zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=self.flat_param.device)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()

"""`FlatParamGroup`: one bucket of parameters and everything it owns.

A group lays its parameters end to end in one padded flat buffer, sharded evenly across the
data-parallel group. It owns its gradient storage, its fp32 master-weight shard and its in-flight
collectives, so the engine only has to say *when* to reduce, gather or release.

What each stage keeps per rank (``N`` ranks, ``S = padded_numel / N``):

=====  =====================================  ===============================  ==============
stage  parameters                             gradients and their reduction    master (fp32)
=====  =====================================  ===============================  ==============
0      full ``flat_param`` (params are views)  full ``flat_grad``, all-reduced  whole buffer
                                              in place
1      full ``flat_param``                    full ``flat_grad``, reduce-       shard of ``S``
                                              scattered into its own region
2      full ``flat_param``                    reduced shard (16-bit; fp32      shard of ``S``
                                              across a window), every backward
3      16-bit ``shard`` of ``S``; the full    as stage 2                       shard of ``S``
       buffer exists only while gathered
=====  =====================================  ===============================  ==============

In fp32 without offload the master is not a copy: it is this rank's region of ``flat_param``
(stage 3: the ``shard``), stepped in place. The reduced gradient waits for the step in ``grads``
(`hf_zero.grad_store.GradStore`).

A stage-3 group may be frozen (``trainable=False``): it is sharded and gathered like any other
but has no master weights and no gradients.

With ``offload=True`` (ZeRO-Offload, stages 1-3) the master shard, its gradient and the optimizer
state live in host memory: reduced gradient shards are copied device-to-host, the optimizer steps
on the host, and updated values go host-to-device before the usual gather. On CUDA the host
buffers are pinned and the copies asynchronous; on CPU the same path runs with the same copies.

ZeRO++ (``zeropp``, stage 3): qwZ gathers the shard as INT8 plus block scales; hpZ keeps, from
the first gather after a step, a *secondary shard* (``1/hpz`` of the buffer) so later gathers -
backward's above all - stay inside the hpZ group. qgZ (stages 2-3) reduce-scatters gradients by
`QuantizedReduceScatter`. Exact gathers (checkpoints, ``gathered_parameters``) bypass both.

MixZ++ (``zeropp.quantized_nontrainable_weights``): a frozen stage-3 group quantizes its shard
once, from the original fp32 values, and keeps only that (``quantized_params`` in `held_bytes`);
gathers all-gather the quantized shards and dequantize them, and its hpZ secondary (a slice of
those rows) is kept for the whole run, since frozen weights never change.
"""

from __future__ import annotations

import torch

from hf_zero.comm import (
    Collectives,
    QuantizedGather,
    QuantizedReduceScatter,
    ZeroPPSettings,
    quantize_shard,
)
from hf_zero.grad_store import GradStore, start_copy
from hf_zero.memory import group_held_bytes
from hf_zero.partition import FlatLayout
from hf_zero.quant import Quantized
from hf_zero.shard_tiers import TIERS, DeviceTier
from hf_zero.topology import Group


class FlatParamGroup:
    """A bucket of same-dtype parameters from one optimizer param group (or frozen ones)."""

    def __init__(
        self,
        index: int,
        param_group_index: int | None,
        names: list[str],
        params: list[torch.nn.Parameter],
        stage: int,
        dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        shard_group: Group,
        rank: int,
        comm: Collectives,
        offload: bool = False,
        zeropp: ZeroPPSettings | None = None,
        param_tier: str = "none",
    ) -> None:
        self.index = index
        self.zeropp = zeropp or ZeroPPSettings()
        self.tp_split = False
        """AutoTP: the parameters are this rank's slices (their gradient norms add over TP)."""
        self.offload = offload
        self.host = torch.device("cpu")
        self.param_group_index = param_group_index
        self.trainable = param_group_index is not None
        self.params = params
        self.names = names
        self.stage = stage
        self.dtype = dtype
        self.reduce_dtype = reduce_dtype
        self.comm = comm
        # Stage 0 does not partition the optimizer: one "shard" covering the whole buffer.
        self.shard_group = shard_group
        self.comm_rank = rank
        num_shards = shard_group.size if stage >= 1 else 1
        self.shard_index = shard_group.rank_of(rank) if stage >= 1 else 0
        self.layout = FlatLayout(names, [p.shape for p in params], num_shards)
        self.device = params[0].device

        # fp32 master weights come from the parameters' original values, before any cast to
        # 16 bits, so mixed precision loses nothing at initialisation.
        full32 = torch.zeros(self.layout.padded_numel, dtype=torch.float32, device=self.device)
        for slot, p in zip(self.layout.slots, params):
            full32[slot.offset : slot.end].copy_(p.detach().reshape(-1))
        start, end = self.layout.shard_range(self.shard_index)
        fp32 = dtype == torch.float32
        self.flat_param: torch.Tensor | None = None
        self.tier: DeviceTier | None = None  # stage 3: where the 16-bit shard lives
        self.quantized_shard: Quantized | None = None  # MixZ++: the frozen shard, for good
        zpp = self.zeropp
        if stage == 3 and not self.trainable and zpp.quantized_nontrainable_weights:
            self.quantized_shard = quantize_shard(
                full32[start:end], zpp.weight_bits, zpp.block_size
            )
            owner = None
        elif stage == 3:
            self.tier = TIERS[param_tier](full32[start:end].to(dtype), self.device)
            owner = self.tier.data if param_tier == "none" else None
        else:
            self.flat_param = full32 if fp32 else full32.to(dtype)
            owner = self.flat_param
        # In fp32 the master weights *are* the parameters, no copy: stage 3 steps its shard in
        # place, stages 0-2 this rank's region of flat_param (stages 1-2 then all-gather the
        # other regions; stage 0's region is the whole buffer).
        self.master_aliases_params = fp32 and not offload and owner is not None
        self.master: torch.nn.Parameter | None = None
        if self.trainable:
            if self.master_aliases_params:
                master = owner if stage == 3 else owner[start:end]
            elif offload:
                master = self._host_empty(self.layout.shard_numel).copy_(full32[start:end])
            else:
                master = full32[start:end].clone()
            self.master = torch.nn.Parameter(master, requires_grad=False)
        # The reduced gradient from its reduction to the step (see hf_zero.grad_store).
        self.grads = GradStore(self.master, shard_group.size) if self.trainable else None
        self._staging: torch.Tensor | None = None  # offload: updated shard on its way to the device
        self._staged = False
        del full32
        self._gather_work = None
        # hpZ: this rank's slice of the full buffer (quantized rows for a MixZ++ group)
        self._secondary: torch.Tensor | Quantized | None = None
        self._keep_secondary = False
        self._quantized_reduce = None
        if self.zeropp.quantized_gradients and stage >= 2 and self.trainable:
            self._quantized_reduce = QuantizedReduceScatter(
                comm, self.zeropp, self.layout.padded_numel
            )
        if stage == 3:
            self._release_views()
        else:
            self._point_params_at(self.flat_param)

        # Stages 0-1 keep full gradients in one flat buffer, as views autograd accumulates into.
        self.flat_grad: torch.Tensor | None = None
        self._grad_views: list[torch.Tensor] = []
        if stage < 2:
            self.flat_grad = self._new_zeros(self.layout.padded_numel, dtype)
            for slot, p in zip(self.layout.slots, params):
                view = self.flat_grad[slot.offset : slot.end].view(slot.shape)
                p.grad = view
                self._grad_views.append(view)

        # Per-backward state.
        self.received = False  # a gradient arrived since the last reduction
        self._ready = [False] * len(params)
        self.num_ready = 0
        self.launched = False
        self._alone = len(params) == 1 and self.layout.padded_numel == params[0].numel()
        self._reduce_input: torch.Tensor | None = None  # stage 2-3: this backward's gradients
        self._reduce_output: torch.Tensor | None = None
        self._work = None

    @property
    def numel(self) -> int:
        return self.layout.padded_numel

    # --- stage 3: gather and release ---------------------------------------------------------
    def gather(self, async_op: bool = False, exact: bool = False) -> None:
        """Start assembling the full parameters from every rank's shard (stage 3).

        With ZeRO++ on, the gather reads the hpZ secondary shards when they are current, else
        quantizes (qwZ); ``exact=True`` always all-gathers the 16-bit primary shards.
        """
        if self.flat_param is not None:
            return
        self.flat_param = torch.empty(
            self.layout.padded_numel, dtype=self.dtype, device=self.device
        )
        zpp = self.zeropp
        self._keep_secondary = False
        # A MixZ++ group has nothing but its quantized shard: every gather is "exact" for it.
        secondary = self._secondary if not exact or self.quantized_shard is not None else None
        if isinstance(secondary, Quantized):
            self._gather_work = QuantizedGather(
                self.comm, self.flat_param, secondary, zpp.hpz, async_op
            )
        elif secondary is not None:
            self._gather_work = self.comm.all_gather(
                self.flat_param, secondary, zpp.hpz, async_op=async_op
            )
        elif self.quantized_shard is not None:
            self._gather_work = QuantizedGather(
                self.comm, self.flat_param, self.quantized_shard, self.shard_group, async_op
            )
            self._keep_secondary = zpp.hpz is not None
        elif not exact and zpp.quantized_weights and self.shard_group.size > 1:
            local = quantize_shard(self.tier.fetch(), zpp.weight_bits, zpp.block_size)
            self._gather_work = QuantizedGather(
                self.comm, self.flat_param, local, self.shard_group, async_op
            )
            self._keep_secondary = zpp.hpz is not None
        else:
            self._gather_work = self.comm.all_gather(
                self.flat_param, self.tier.fetch(), self.shard_group, async_op=async_op
            )
            self._keep_secondary = not exact and zpp.hpz is not None
        if not async_op:
            self.wait_gather()

    def wait_gather(self) -> None:
        """Finish a gather started with ``async_op=True`` and point the parameters at it."""
        work, self._gather_work = self._gather_work, None
        if work is not None:
            work.wait()
        if self._keep_secondary:
            # hpZ: keep the values this forward used, so backward gathers the same ones.
            self._keep_secondary = False
            hpz = self.zeropp.hpz
            index = hpz.rank_of(self.comm_rank)
            if self.quantized_shard is not None:
                q = work.gathered
                rows = q.data.shape[0] // hpz.size
                keep = slice(index * rows, (index + 1) * rows)
                self._secondary = Quantized(
                    q.data[keep].clone(), q.scales[keep].clone(), q.numel, q.bits, q.block_size
                )
            else:
                size = self.layout.padded_numel // hpz.size
                self._secondary = self.flat_param[index * size : (index + 1) * size].clone()
        self._point_params_at(self.flat_param)

    def drop_secondary(self) -> None:
        """hpZ: forget the secondary shard (the parameters changed, e.g. an optimizer step).

        A MixZ++ group keeps its own: frozen quantized weights never change.
        """
        if self.quantized_shard is None:
            self._secondary = None

    def release(self) -> None:
        """Free the full parameters; only this rank's shard stays (stage 3)."""
        if self.stage != 3 or self.flat_param is None:
            return
        if self._gather_work is not None:
            self._gather_work.wait()
            self._gather_work = None
        self.flat_param = None
        self._release_views()

    def _point_params_at(self, flat: torch.Tensor) -> None:
        for slot, p in zip(self.layout.slots, self.params):
            p.data = flat[slot.offset : slot.end].view(slot.shape)

    def _release_views(self) -> None:
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        for p in self.params:
            p.data = empty

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
            grad = p.grad.reshape(-1)
            if self._reduce_input is None and self._alone and grad.dtype == self.reduce_dtype:
                # One parameter fills the bucket (a large embedding): reduce its gradient
                # itself. p.grad is cleared below, so autograd never writes into it again.
                self._reduce_input = grad
            elif self._reduce_input is None:
                # Not zero-filled: each slot's first gradient is copied in, and what no
                # gradient reached is zeroed at launch (a memset and a read saved per bucket).
                self._reduce_input = torch.empty(
                    self.layout.padded_numel, dtype=self.reduce_dtype, device=self.device
                )
            slot = self.layout.slots[i]
            target = self._reduce_input[slot.offset : slot.end]
            if target.data_ptr() == grad.data_ptr():
                pass  # the gradient itself, taken above
            elif self._ready[i]:
                target.add_(grad)  # a second use in this backward
            else:
                target.copy_(grad)
            p.grad = None  # stages 2-3 never keep a full gradient beyond its bucket
        self.received = True
        if not self._ready[i]:
            self._ready[i] = True
            self.num_ready += 1

    def launch_reduce(self, async_op: bool, output: torch.Tensor | None = None) -> None:
        """Start this bucket's gradient reduction (all-reduce for stage 0, else reduce-scatter
        into ``output``, ``shard_numel`` elements, or a new buffer)."""
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
        else:
            self._zero_unfilled(self._reduce_input)
        if self._quantized_reduce is not None:
            self._quantized_reduce.launch(self._reduce_input, async_op=async_op)
            return
        # Every element is written by the reduction: no zero fill.
        self._reduce_output = output if output is not None else self._new_shard()
        self._work = self.comm.reduce_scatter(
            self._reduce_output, self._reduce_input, group, async_op=async_op
        )
        if self.stage >= 2:
            # The full-size input is a backward's largest buffer: dropped here, it lives only
            # until its reduction is done (the exchange or work handle holds it till then), not
            # until the end of backward, so at most the buckets in flight are resident at once.
            self._reduce_input = None

    def wait_reduce(self) -> None:
        """Wait for the launched reduction; `finish_reduce` still hands its result over."""
        if self._work is not None:
            self._work.wait()

    def _zero_unfilled(self, flat: torch.Tensor) -> None:
        """Zero what no gradient was copied into this backward: padding and unused slots."""
        end = 0
        for slot, ready in sorted(zip(self.layout.slots, self._ready), key=lambda x: x[0].offset):
            if ready:
                flat[end : slot.offset].zero_()
                end = slot.end
        flat[end:].zero_()

    def finish_reduce(self, received: bool = True) -> None:
        """Wait for the reduction and hand the summed gradient to ``grads`` (`GradStore`).

        ``received=False`` (no rank had a gradient for this bucket) leaves it as it is, so a
        bucket unused everywhere is skipped by the optimizer rather than stepped with 0.
        """
        if self._quantized_reduce is not None:
            self._reduce_output = self._quantized_reduce.finish()
        elif self._work is not None:
            self._work.wait()
        reduced = self._reduce_output
        accumulate = self.stage >= 2  # stages 0-1 reduce a whole window's sum at once
        in_place = self.stage == 1 and self._reduce_input is self.flat_grad
        if in_place:
            # Stage 1 keeps the sum in flat_grad's own region (no second gradient buffer) and
            # zeroes the rest: a later synced backward before the step (DDP-style accumulation)
            # adds to it, and the next reduction is again the exact total.
            start, end = self.layout.shard_range(self.shard_index)
            reduced = self.flat_grad[start:end].copy_(reduced)
            self.flat_grad[:start].zero_()
            self.flat_grad[end:].zero_()
        if not received:
            pass
        elif self.offload:
            host = self._host_empty(reduced.numel())
            self.grads.fold_host(host, start_copy(host, reduced), accumulate)
        elif self.stage == 0 and reduced is self.flat_grad and reduced.dtype != torch.float32:
            # 16-bit stage 0 reduced flat_grad itself: average it in place, as DDP does, so a
            # later synced backward before the step (DDP-style accumulation) adds to an average
            # and the next all-reduce is again the exact total.
            self.grads.fold(reduced.div_(self.shard_group.size), False, averaged=True)
        else:
            self.grads.fold(reduced, accumulate, average_now=not in_place)
        self._work = self._reduce_input = self._reduce_output = None
        self.reset_backward()
        self.launched = False
        self.received = False

    def reset_backward(self) -> None:
        """Forget readiness after a backward that did not reduce (stages 0-1 inside no_sync)."""
        self._ready = [False] * len(self.params)
        self.num_ready = 0

    # --- after the optimizer step ------------------------------------------------------------
    def gather_params(self, async_op: bool):
        """Bring the parameters up to date with the stepped master weights."""
        self.drop_secondary()
        if self.master_aliases_params and self.stage in (0, 3):
            return None  # the step updated the parameters themselves
        updated = self.master.detach()
        if self.offload:
            if not self._staged:
                self.stage_tile(0, updated.numel())
            self._staged = False
            if self.stage == 3:
                return None  # stage_tile wrote the device shard itself
            return self.comm.all_gather(
                self.flat_param, self._staging, self.shard_group, async_op=async_op
            )
        if self.stage == 0:
            self.flat_param.copy_(updated)
            return None
        if self.stage == 3:
            self.tier.write_(updated)  # the next forward gathers it
            return None
        shard = updated.to(self.dtype)  # fp32: flat_param's own region, gathered in place
        return self.comm.all_gather(self.flat_param, shard, self.shard_group, async_op=async_op)

    def stage_tile(self, start: int, end: int) -> None:
        """Offload: start copying updated master elements ``[start, end)`` to the device."""
        tile = self.master.detach()[start:end]
        if self.stage == 3:
            self.tier.write_(tile, start, non_blocking=True)
        else:
            if self._staging is None:
                self._staging = self._new_shard(self.dtype)
            self._staging[start:end].copy_(tile, non_blocking=True)
        self._staged = True

    def publish_from(self, src: int) -> None:
        """While gathered: broadcast the full parameters from global rank ``src`` and make the
        shard and fp32 master weights follow, so the change survives the next step."""
        self.comm.broadcast(self.flat_param, src, self.shard_group)
        self._secondary = None
        start, end = self.layout.shard_range(self.shard_index)
        if self.tier is not None:
            self.tier.write_(self.flat_param[start:end])
        if self.quantized_shard is not None:
            bits, block = self.zeropp.weight_bits, self.zeropp.block_size
            self.quantized_shard = quantize_shard(self.flat_param[start:end], bits, block)
        if self.master is not None and not self.master_aliases_params:
            self.master.data.copy_(self.flat_param[start:end].float())

    def drop_staging(self) -> None:
        """Offload: free the device copy of the updated shard once it has been gathered."""
        self._staging = None

    def zero_grad(self) -> None:
        if self.grads is not None:
            self.grads.clear()
        if self.flat_grad is not None:
            self.flat_grad.zero_()
            for p, view in zip(self.params, self._grad_views):
                p.grad = view
        else:
            for p in self.params:
                p.grad = None

    # --- inspection --------------------------------------------------------------------------
    def held_bytes(self) -> dict[str, int]:
        """Bytes this group holds now, by kind; ``host_*`` kinds are in host memory (offload)."""
        return group_held_bytes(self)

    def full_master(self) -> torch.Tensor:
        """The whole fp32 master buffer, gathered across the shard group (collective)."""
        if self.layout.num_shards == 1:
            return self.master.detach().float()
        full = self._new_zeros(self.layout.padded_numel, torch.float32)
        shard = self.master.detach().to(self.device, torch.float32)
        self.comm.all_gather(full, shard, self.shard_group)
        return full

    def _host_empty(self, numel: int) -> torch.Tensor:
        pin = self.device.type == "cuda"
        return torch.empty(numel, dtype=torch.float32, device=self.host, pin_memory=pin)

    def _as_reduce_dtype(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.dtype == self.reduce_dtype else t.to(self.reduce_dtype)

    def _new_shard(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.reduce_dtype
        return torch.empty(self.layout.shard_numel, dtype=dtype, device=self.device)

    def _new_zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=self.device)

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
(`hf_zero.sharding.grad_store.GradStore`).

A stage-3 group may be frozen (``trainable=False``): it is sharded and gathered like any other
but has no master weights and no gradients. A frozen group of bitsandbytes parameters
(``packed=True``, `hf_zero.numerics.packed`) holds their bytes as ``uint8``: sharded, gathered and stored
in any tier as they are, never cast, quantized or reduced.

With ``offload=True`` (ZeRO-Offload, stages 1-3) the master shard, its gradient and the optimizer
state live in host memory: reduced gradient shards are copied device-to-host, the optimizer steps
on the host, and updated values go host-to-device before the usual gather. On CUDA the host
buffers are pinned and the copies asynchronous; on CPU the same path runs with the same copies.

The group is the *when*; three kinds of small objects hold the *how* and the *where*:

* a storage tier (`hf_zero.sharding.tiers`): where a stage-3 shard lives between gathers - device, host
  (``offload_param: cpu``), a swap file (``nvme``) or INT8 blocks (MixZ++, frozen groups);
* a gather codec and a reduce codec (`hf_zero.sharding.codecs`): exact, qwZ or hpZ gathers; all-reduce,
  reduce-scatter or qgZ reductions. Exact gathers (checkpoints, ``gathered_parameters``) bypass
  qwZ and hpZ;
* a gradient intake (`hf_zero.sharding.grad_intake`): stages 0-1 accumulate in ``flat_grad``, stages 2-3
  copy into the bucket's reduction input.

With ``offload_optimizer: nvme`` the master shard, its gradient and the optimizer state are in
swap files (`hf_zero.sharding.swapped_state.SwappedState`), and the step streams them.
"""

from __future__ import annotations

import torch

from hf_zero.comm import Collectives, ZeroPPSettings
from hf_zero.comm.topology import Group
from hf_zero.numerics.packed import PackedViews
from hf_zero.sharding.accounting import group_held_bytes
from hf_zero.sharding.codecs import ExactGather, QgZReduce, gather_codec, reduce_codec
from hf_zero.sharding.grad_intake import BucketGrads, FlatGrads
from hf_zero.sharding.grad_store import GradStore, start_copy
from hf_zero.sharding.layout import FlatLayout
from hf_zero.sharding.tiers import PARAM_TIERS, QuantizedTier, Tier
from hf_zero.storage.swap import SwapSpace


class FlatParamGroup:
    """A bucket of same-dtype parameters from one optimizer param group (or frozen ones).

    ``param_tier`` (stage 3) names where the shard lives (`hf_zero.sharding.tiers.PARAM_TIERS`);
    ``param_swap`` / ``optimizer_swap`` are the rank's swap spaces for the NVMe tiers.
    """

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
        param_swap: SwapSpace | None = None,
        optimizer_swap: SwapSpace | None = None,
        packed: bool = False,
    ) -> None:
        self.index = index
        self.zeropp = zpp = zeropp or ZeroPPSettings()
        self.tp_split = False
        """AutoTP: the parameters are this rank's slices (their gradient norms add over TP)."""
        self.param_group_index = param_group_index
        self.trainable = param_group_index is not None
        self.offload = offload or (optimizer_swap is not None and self.trainable)
        """Master weights, their gradient and the optimizer step are on the host (cpu or nvme)."""
        self.host = torch.device("cpu")
        self.params, self.names, self.stage = params, names, stage
        self.dtype, self.reduce_dtype, self.comm = dtype, reduce_dtype, comm
        # Stage 0 does not partition the optimizer: one "shard" covering the whole buffer.
        self.shard_group = shard_group
        self.comm_rank = rank
        num_shards = shard_group.size if stage >= 1 else 1
        self.shard_index = shard_group.rank_of(rank) if stage >= 1 else 0
        self.device = params[0].device
        # bitsandbytes parameters (frozen, stage 3): their bytes, sharded as uint8, never cast.
        self.packed = PackedViews(params) if packed else None
        shapes = self.packed.byte_shapes() if packed else [p.shape for p in params]
        self.layout = FlatLayout(names, shapes, num_shards)
        if packed:
            self.dtype = dtype = torch.uint8
            full32 = torch.zeros(self.layout.padded_numel, dtype=dtype, device=self.device)
            self.packed.fill(full32, self.layout.slots, params)
        else:
            # fp32 master weights come from the parameters' original values, before any cast
            # to 16 bits, so mixed precision loses nothing at initialisation.
            full32 = torch.zeros(self.layout.padded_numel, dtype=torch.float32, device=self.device)
            for slot, p in zip(self.layout.slots, params):
                full32[slot.offset : slot.end].copy_(p.detach().reshape(-1))
        start, end = self.layout.shard_range(self.shard_index)
        fp32 = dtype == torch.float32
        self.flat_param: torch.Tensor | None = None
        self.tier: Tier | None = None  # stage 3: where the shard lives between gathers
        mixz = zpp.quantized_nontrainable_weights and not packed  # bnb bytes stay as they are
        if stage == 3 and not self.trainable and mixz:
            self.tier = QuantizedTier(full32[start:end], self.device, zpp)
        elif stage == 3:
            self.tier = PARAM_TIERS[param_tier](
                full32[start:end].to(dtype), self.device, param_swap
            )
        else:
            self.flat_param = full32 if fp32 else full32.to(dtype)
        owner = self.flat_param if stage < 3 else getattr(self.tier, "data", None)
        # In fp32 the master weights *are* the parameters, no copy: stage 3 steps its device
        # shard in place, stages 0-2 this rank's region of flat_param (stages 1-2 then all-gather
        # the other regions; stage 0's region is the whole buffer).
        in_place = stage < 3 or param_tier == "none"
        self.master_aliases_params = fp32 and not self.offload and in_place and owner is not None
        self.master: torch.nn.Parameter | None = None
        self.swapped = None  # offload_optimizer: nvme - master, gradient and state on disk
        if self.trainable:
            if self.master_aliases_params:
                master = owner if stage == 3 else owner[start:end]
            elif optimizer_swap is not None:
                from hf_zero.sharding.swapped_state import SwappedState

                self.swapped = SwappedState(optimizer_swap, full32[start:end], shard_group.size)
                master = torch.empty(0, dtype=torch.float32)  # the bytes are in the swap file
            elif self.offload:
                master = self._host_empty(self.layout.shard_numel).copy_(full32[start:end])
            else:
                master = full32[start:end].clone()
            self.master = torch.nn.Parameter(master, requires_grad=False)
        # The reduced gradient from its reduction to the step (see hf_zero.sharding.grad_store).
        self.grads = None
        if self.swapped is not None:
            self.grads = self.swapped.grads
        elif self.trainable:
            self.grads = GradStore(self.master, shard_group.size)
        self._staging: torch.Tensor | None = None  # offload: updated shard on its way to the device
        self._staged = False
        del full32

        self.gather_codec = self.exact_gather = None
        self._gather_work = None
        self._gathering_with = None  # the codec of the gather in flight
        if stage == 3:
            # Packed bytes are never re-quantized by qwZ; hpZ may keep copies of them.
            permanent = self.tier.permanent or packed
            self.gather_codec = gather_codec(comm, zpp, shard_group, rank, permanent)
            # A MixZ++ group has nothing but its quantized shard: every gather is "exact" for it.
            exact = ExactGather(comm, shard_group, zpp)
            self.exact_gather = self.gather_codec if permanent else exact
            self._release_views()
        else:
            self._point_params_at(self.flat_param)
        self.reduce_codec = None
        if self.trainable:
            self.reduce_codec = reduce_codec(comm, zpp, stage, shard_group, self.numel)
        if stage < 2:
            self.intake = FlatGrads(self.layout, params, dtype, self.device)
        else:
            self.intake = BucketGrads(self.layout, params, reduce_dtype, self.device)

        # Per-backward state.
        self.received = False  # a gradient arrived since the last reduction
        self._ready = [False] * len(params)
        self.num_ready = 0
        self.launched = False
        self._reduce_input: torch.Tensor | None = None  # stage 1: flat_grad while it reduces
        self._landed = False  # NVMe optimizer: this backward's reduction is already written

    @property
    def numel(self) -> int:
        return self.layout.padded_numel

    @property
    def flat_grad(self) -> torch.Tensor | None:
        """Stages 0-1: the full gradients of the window (``p.grad`` are views of it)."""
        return self.intake.flat_grad

    @property
    def _quantized_reduce(self) -> QgZReduce | None:
        """The qgZ codec when gradients are quantized (inspection: error-feedback residuals)."""
        return self.reduce_codec if isinstance(self.reduce_codec, QgZReduce) else None

    # --- stage 3: gather and release ---------------------------------------------------------
    def gather(self, async_op: bool = False, exact: bool = False) -> None:
        """Start assembling the full parameters from every rank's shard (stage 3).

        ``exact=True`` bypasses qwZ and hpZ: it all-gathers the 16-bit primary shards.
        """
        if self.flat_param is not None:
            return
        self.flat_param = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        codec = self.exact_gather if exact else self.gather_codec
        self._gathering_with = codec
        self._gather_work = codec.launch(self.flat_param, self.tier, async_op)
        if not async_op:
            self.wait_gather()

    @property
    def gather_pending(self) -> bool:
        """A gather was started and its parameters are not pointed at it yet."""
        return self._gathering_with is not None

    def prefetch_shard(self) -> None:
        """Start reading this group's shard ahead of its gather (NVMe tier; else a no-op)."""
        if self.tier is not None and self.flat_param is None:
            self.tier.prefetch()

    def wait_gather(self) -> None:
        """Finish a gather started with ``async_op=True`` and point the parameters at it."""
        work, self._gather_work = self._gather_work, None
        if work is not None:
            work.wait()
        codec, self._gathering_with = self._gathering_with, None
        if codec is not None:
            codec.finish(self.flat_param, work)
        self._point_params_at(self.flat_param)

    def drop_secondary(self) -> None:
        """hpZ: forget the secondary shard (the parameters changed, e.g. an optimizer step).

        A MixZ++ group keeps its own: frozen quantized weights never change.
        """
        if self.gather_codec is not None:
            self.gather_codec.forget()

    def release(self) -> None:
        """Free the full parameters; only this rank's shard stays (stage 3)."""
        if self.stage != 3 or self.flat_param is None:
            return
        if self._gather_work is not None:
            self._gather_work.wait()
            self._gather_work = self._gathering_with = None
        self.flat_param = None
        self._release_views()

    def _point_params_at(self, flat: torch.Tensor) -> None:
        if self.packed is not None:
            self.packed.point(flat, self.layout.slots, self.params)
            return
        for slot, p in zip(self.layout.slots, self.params):
            p.data = flat[slot.offset : slot.end].view(slot.shape)

    def _release_views(self) -> None:
        if self.packed is not None:
            self.packed.release(self.params, self.device)
            return
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        for p in self.params:
            p.data = empty

    # --- backward ----------------------------------------------------------------------------
    @property
    def all_ready(self) -> bool:
        return self.num_ready == len(self.params)

    def on_grad_ready(self, i: int) -> None:
        """Take parameter ``i``'s freshly accumulated gradient into the group's storage."""
        if self.launched:
            raise RuntimeError(
                f"hf_zero: parameter '{self.layout.slots[i].name}' received a gradient after its "
                "bucket was already reduced in this backward pass (the parameter is used again "
                "late in backward, e.g. by reentrant activation checkpointing). Set "
                "'overlap_comm': false to reduce only when backward has finished."
            )
        self.intake.take(i, self._ready[i])
        self.received = True
        if not self._ready[i]:
            self._ready[i] = True
            self.num_ready += 1

    def launch_reduce(self, async_op: bool, output: torch.Tensor | None = None) -> None:
        """Start this bucket's gradient reduction (all-reduce for stage 0, else reduce-scatter
        into ``output``, ``shard_numel`` elements, or a new buffer)."""
        self.launched = True
        full = self.intake.reduction_input(self.reduce_dtype, self._ready)
        if self.reduce_codec.takes_output and output is None:
            output = self._new_shard()
        self.reduce_codec.launch(full, output, async_op)
        # Stage 1 reduces flat_grad itself and keeps the sum in its own region (finish_reduce).
        self._reduce_input = full if self.stage == 1 else None

    def wait_reduce(self) -> None:
        """Wait for the launched reduction; `finish_reduce` still hands its result over."""
        self.reduce_codec.wait()

    def land_reduction(self) -> None:
        """NVMe optimizer: write the finished reduction out now rather than at the end of
        backward (only then does every rank know whether any had a gradient: `finish_reduce`
        commits it). A no-op for other groups."""
        if self.swapped is None or not self.launched or self._landed:
            return
        reduced = self.reduce_codec.finish()
        host = self.swapped.space.buffer(reduced.numel(), torch.float32)  # written out as is
        self.grads.fold_host(host, start_copy(host, reduced), accumulate=True)
        self._landed = True

    def finish_reduce(self, received: bool = True) -> None:
        """Wait for the reduction and hand the summed gradient to ``grads`` (`GradStore`).

        ``received=False`` (no rank had a gradient for this bucket) leaves it as it is, so a
        bucket unused everywhere is skipped by the optimizer rather than stepped with 0.
        """
        if self.swapped is not None:
            self.land_reduction()
            self.grads.commit(received)
            self._landed = False
            self._end_reduction()
            return
        reduced = self.reduce_codec.finish()
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
        self._end_reduction()

    def _end_reduction(self) -> None:
        self._reduce_input = None
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
        self.release()  # stage 3: a copy gathered before the step would be stale
        self.drop_secondary()
        if self.master_aliases_params and self.stage in (0, 3):
            return None  # the step updated the parameters themselves
        staged, self._staged = self._staged, False
        if self.swapped is not None and not staged:
            return None  # not stepped (no gradient anywhere): the parameters did not change
        if self.offload and not staged:
            self.stage_tile(0, self.layout.shard_numel)
            self._staged = False
        if self.offload and self.stage == 3:
            self.tier.flush()
            return None  # stage_tile wrote the shard itself
        if self.offload:
            return self.comm.all_gather(
                self.flat_param, self._staging, self.shard_group, async_op=async_op
            )
        updated = self.master.detach()
        if self.stage == 0:
            self.flat_param.copy_(updated)
            return None
        if self.stage == 3:
            self.tier.write_(updated)  # the next forward gathers it
            return None
        shard = updated.to(self.dtype)  # fp32: flat_param's own region, gathered in place
        return self.comm.all_gather(self.flat_param, shard, self.shard_group, async_op=async_op)

    def stage_tile(self, start: int, end: int, values: torch.Tensor | None = None) -> None:
        """Offload: start copying updated master elements ``[start, end)`` (``values``, or read
        from ``master``) to where the parameters live."""
        tile = self.master.detach()[start:end] if values is None else values
        if self.stage == 3:
            self.tier.write_(tile.to(self.dtype), start, non_blocking=True)
        else:
            if self._staging is None:
                self._staging = self._new_shard(self.dtype)
            self._staging[start:end].copy_(tile, non_blocking=True)
        self._staged = True

    def publish_from(self, src: int) -> None:
        """While gathered: broadcast the full parameters from global rank ``src`` and make the
        shard and fp32 master weights follow, so the change survives the next step."""
        self.comm.broadcast(self.flat_param, src, self.shard_group)
        if self.gather_codec is not None:
            self.gather_codec.forget(permanent_too=True)
        start, end = self.layout.shard_range(self.shard_index)
        if self.tier is not None:
            self.tier.write_(self.flat_param[start:end])
        if self.swapped is not None:
            self.swapped.write_master(self.flat_param[start:end].float())
        elif self.master is not None and not self.master_aliases_params:
            self.master.data.copy_(self.flat_param[start:end].float())

    def drop_staging(self) -> None:
        """Offload: free the device copy of the updated shard once it has been gathered."""
        self._staging = None

    def zero_grad(self) -> None:
        if self.grads is not None:
            self.grads.clear()
        self.intake.zero_grad()

    # --- inspection --------------------------------------------------------------------------
    def held_bytes(self) -> dict[str, int]:
        """Bytes this group holds now, by kind; ``host_*`` kinds are in host memory (offload),
        ``nvme_*`` kinds in swap files."""
        return group_held_bytes(self)

    def master_values(self) -> torch.Tensor:
        """This rank's fp32 master shard (read from its swap file under NVMe offload)."""
        if self.swapped is not None:
            return self.swapped.read_master()
        return self.master.detach()

    def full_master(self) -> torch.Tensor:
        """The whole fp32 master buffer, gathered across the shard group (collective)."""
        if self.layout.num_shards == 1:
            return self.master_values().float()
        full = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        shard = self.master_values().to(self.device, torch.float32)
        self.comm.all_gather(full, shard, self.shard_group)
        return full

    def _host_empty(self, numel: int) -> torch.Tensor:
        pin = self.device.type == "cuda"
        return torch.empty(numel, dtype=torch.float32, device=self.host, pin_memory=pin)

    def _new_shard(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.reduce_dtype
        return torch.empty(self.layout.shard_numel, dtype=dtype, device=self.device)

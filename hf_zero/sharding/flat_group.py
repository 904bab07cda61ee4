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

The group is the *when*; small objects chosen once, at construction, hold the *how* and the
*where*, so no method of the group asks which stage, precision or offload it runs:

* its placement (`hf_zero.sharding.placement`): the whole buffer (stage 0), the whole buffer
  with this rank's region all-gathered after the step (stages 1-2), or a shard in a storage tier
  (stage 3, `hf_zero.sharding.tiers`: device, host, swap file, INT8 blocks for MixZ++);
* its master weights (`hf_zero.sharding.master`): none (frozen), the parameters themselves (fp32),
  an fp32 copy on the device, in host memory (``offload_optimizer: cpu``) or in swap files
  (``nvme``, `hf_zero.sharding.swapped_state.SwappedState`, the step streams them);
* a gather codec and a reduce codec (`hf_zero.sharding.codecs`): exact, qwZ or hpZ gathers;
  all-reduce, reduce-scatter or qgZ reductions. Exact gathers (checkpoints,
  ``gathered_parameters``) bypass qwZ and hpZ;
* a gradient intake (`hf_zero.sharding.grad_intake`): stage 0 all-reduces ``flat_grad``, stage 1
  reduce-scatters it and keeps the sum in its own region, stages 2-3 copy into the bucket's
  reduction input.

One word per event of a group's life: ``gather`` / ``release`` (stage 3: the full parameters
assembled from the shards, and dropped again; ``prefetch_shard`` reads an NVMe shard ahead of
its gather; ``release_secondary`` drops hpZ's secondary shard, ``release_staged`` the device
copy of an offloaded update once gathered); ``launch_reduce`` / ``wait_reduce`` /
``land_reduce`` / ``finish_reduce`` (a gradient reduction started, waited for, copied out to an
offloaded master's storage, handed to the master weights); ``refresh_params`` (after the step,
the parameters follow the stepped master weights); ``broadcast_from`` (a rank's edit of the
gathered parameters becomes everyone's).
"""

from __future__ import annotations

import zlib

import torch

from hf_zero.numerics.packed import PackedViews
from hf_zero.sharding.accounting import group_held_bytes
from hf_zero.sharding.codecs import (
    ExactGather,
    NoGather,
    NoReduce,
    QgZReduce,
    gather_codec,
    reduce_codec,
)
from hf_zero.sharding.grad_intake import grad_intake
from hf_zero.sharding.group_spec import GroupSpec
from hf_zero.sharding.layout import FlatLayout
from hf_zero.sharding.master import TILES_SENT, MasterWeights, master_weights
from hf_zero.sharding.placement import Placement, ReplicatedParams, ShardedParams, WholeParams
from hf_zero.sharding.tiers import PARAM_TIERS, QuantizedTier, ResidentTier, Tier


class FlatParamGroup:
    """A bucket of same-dtype parameters from one optimizer param group (or frozen ones),
    built as ``spec`` (`hf_zero.sharding.group_spec.GroupSpec`) says. ``packed``: the
    parameters are bitsandbytes codes, moved as bytes.
    """

    def __init__(
        self,
        index: int,
        param_group_index: int | None,
        names: list[str],
        params: list[torch.nn.Parameter],
        spec: GroupSpec,
        packed: bool = False,
    ) -> None:
        stage, dtype, reduce_dtype = spec.stage, spec.dtype, spec.reduce_dtype
        shard_group, rank, comm = spec.shard_group, spec.rank, spec.comm
        self.index = index
        self.zeropp = zpp = spec.zeropp
        self.tp_split = False
        """AutoTP: the parameters are this rank's slices (their gradient norms add over TP)."""
        self.counted_in_norm = True
        """The gradients count in the global norm (a pipeline's second copy of a tied weight,
        which another stage counts, does not)."""
        self.param_group_index = param_group_index
        self.trainable = param_group_index is not None
        self.params, self.names, self.stage = params, names, stage
        self.dtype, self.reduce_dtype, self.comm = dtype, reduce_dtype, comm
        self.pool = spec.pool
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
        initial = self._initial_values()
        shard = self.layout.shard_range(self.shard_index)
        self.flat_param: torch.Tensor | None = None  # stage 3: only while gathered
        self.tier: Tier = ResidentTier()  # where the shard lives between gathers (stage 3)
        self.placement = self._placement(initial, shard, spec.param_tier, spec.param_swap)
        self.master_weights: MasterWeights | None = None
        if self.trainable:
            self.master_weights = master_weights(
                initial[shard[0] : shard[1]], self.placement, dtype == torch.float32,
                shard_group.size, spec.offload_optimizer, spec.optimizer_swap,
                pin=self.device.type == "cuda", compact=spec.compact_master,
                state_dtype=spec.state_dtype,
                salt=zlib.crc32("\n".join(names).encode()) * 4096 + self.shard_index,
            )  # fmt: skip
        del initial
        self._gathering_with = self._gather_work = None
        self.gather_codec = self.exact_gather = NoGather()
        if stage == 3:
            self._choose_gather_codecs(permanent=self.tier.permanent or packed)
            self._release_views()
        else:
            self._point_params_at(self.flat_param)
        self.reduce_codec = NoReduce()
        if self.trainable:
            self.reduce_codec = reduce_codec(comm, zpp, stage, shard_group, self.numel)
        self.intake = grad_intake(stage, self.layout, params, dtype, reduce_dtype, shard)

        # Per-backward state.
        self.received = False  # a gradient arrived since the last reduction
        self._ready = [False] * len(params)
        self.num_ready = 0
        self.launched = False

    def _initial_values(self) -> torch.Tensor:
        """The whole padded buffer: fp32 values (masters start from the parameters' values
        before any cast to 16 bits, so mixed precision loses nothing at initialisation), or a
        packed group's bytes."""
        if self.packed is not None:
            flat = torch.zeros(self.numel, dtype=torch.uint8, device=self.device)
            self.packed.fill(flat, self.layout.slots, self.params)
            return flat
        flat = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        for slot, p in zip(self.layout.slots, self.params):
            flat[slot.offset : slot.end].copy_(p.detach().reshape(-1))
        return flat

    def _choose_gather_codecs(self, permanent: bool) -> None:
        """Stage 3: the gather codec (qwZ / hpZ / exact), and the one exact gathers use.
        ``permanent``: the shard never changes (MixZ++, packed bytes): never re-quantized, and
        a MixZ++ group has nothing but its quantized shard, so every gather is "exact" for it."""
        comm, settings, group = self.comm, self.zeropp, self.shard_group
        self.gather_codec = gather_codec(comm, settings, group, self.comm_rank, permanent)
        self.exact_gather = self.gather_codec if permanent else ExactGather(comm, group, settings)

    def _placement(
        self, full32: torch.Tensor, shard: tuple[int, int], param_tier: str, param_swap
    ) -> Placement:
        """The parameters' side: the whole buffer (stages 0-2) or a shard in its tier (3)."""
        if self.stage < 3:
            flat = full32 if self.dtype == torch.float32 else full32.to(self.dtype)
            self.flat_param = flat
            if self.stage == 0:
                return WholeParams(flat)
            return ReplicatedParams(flat, shard, self.comm, self.shard_group)
        values = full32[shard[0] : shard[1]]
        if self.zeropp.quantized_nontrainable_weights and not self.trainable and not self.packed:
            self.tier = QuantizedTier(values, self.device, self.zeropp)  # MixZ++
        else:
            self.tier = PARAM_TIERS[param_tier](values.to(self.dtype), self.device, param_swap)
        return ShardedParams(self.tier, self.dtype)

    @property
    def numel(self) -> int:
        return self.layout.padded_numel

    @property
    def master(self) -> torch.nn.Parameter | None:
        """The fp32 master shard the optimizer steps (empty under NVMe; None when frozen)."""
        return self.master_weights.param if self.master_weights is not None else None

    @property
    def grads(self):
        """The reduced gradient until the step (`hf_zero.sharding.grad_store.GradStore`)."""
        return self.master_weights.grads if self.master_weights is not None else None

    @property
    def swapped(self):
        """``offload_optimizer: nvme``: the swap files of master, gradient and state."""
        return self.master_weights.swapped if self.master_weights is not None else None

    @property
    def offload(self) -> bool:
        """Master weights, their gradient and the optimizer step are on the host."""
        return self.master_weights is not None and self.master_weights.location != "device"

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
        self.flat_param = self.pool.take(self.numel, self.dtype, self.device)
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
        if self.flat_param is None:
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

    def release_secondary(self) -> None:
        """hpZ: release the secondary shard (the parameters changed, e.g. an optimizer step).

        A MixZ++ group keeps its own: frozen quantized weights never change.
        """
        self.gather_codec.release()

    def release(self) -> None:
        """Free the full parameters; only this rank's shard stays (stage 3; stages 0-2 keep
        them: their `ResidentTier` keeps the full parameters)."""
        if self.flat_param is None or self.tier.keeps_full:
            return
        if self._gather_work is not None:
            self._gather_work.wait()
            self._gather_work = self._gathering_with = None
        buffer, self.flat_param = self.flat_param, None
        self._release_views()
        self.pool.give(buffer)  # kept for the next gather of this size, if nothing shares it

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

    def wait_reduce(self) -> None:
        """Wait for the launched reduction; `finish_reduce` still hands its result over."""
        self.reduce_codec.wait()

    def land_reduce(self) -> None:
        """Offloaded optimizer: copy the finished reduction out now rather than at the end of
        backward (only then does every rank know whether any had a gradient: `finish_reduce`
        commits it). A no-op for other groups."""
        if self.launched:
            self.master_weights.land(self.reduce_codec)

    def finish_reduce(self, received: bool = True) -> None:
        """Wait for the reduction and hand the summed gradient to the master weights' ``grads``.

        ``received=False`` (no rank had a gradient for this bucket) leaves them as they are, so
        a bucket unused everywhere is skipped by the optimizer rather than stepped with 0.
        """
        self.master_weights.finish_reduction(self.reduce_codec, self.intake, received)
        self._end_reduction()

    def _end_reduction(self) -> None:
        self.reset_backward()
        self.launched = False
        self.received = False

    def reset_backward(self) -> None:
        """Forget readiness after a backward that did not reduce (stages 0-1 inside no_sync)."""
        self._ready = [False] * len(self.params)
        self.num_ready = 0

    # --- after the optimizer step ------------------------------------------------------------
    def refresh_params(self, async_op: bool):
        """Bring the parameters up to date with the stepped master weights; a collective's
        work handle, or None."""
        self.release()  # stage 3: a copy gathered before the step would be stale
        self.release_secondary()
        update = self.master_weights.updated(self.placement)
        if update is None:
            return None  # the step changed the parameters themselves, or nothing
        return self.placement.publish(None if update is TILES_SENT else update, async_op)

    def send_tile(self, start: int, end: int, values: torch.Tensor | None = None) -> None:
        """Offload: start copying updated master elements ``[start, end)`` (``values``, or read
        from the master) to where the parameters live."""
        self.master_weights.send_tile(start, end, values, self.placement)

    def broadcast_from(self, src: int) -> None:
        """While gathered: broadcast the full parameters from global rank ``src`` and make the
        shard and fp32 master weights follow, so the change survives the next step."""
        self.comm.broadcast(self.flat_param, src, self.shard_group)
        self.gather_codec.release(permanent_too=True)
        start, end = self.layout.shard_range(self.shard_index)
        self.placement.write_shard(self.flat_param[start:end])
        if self.master_weights is not None:
            self.master_weights.set_values(self.flat_param[start:end].float())

    def release_staged(self) -> None:
        """Offload: free the device copy of the updated shard once it has been gathered."""
        self.placement.release_staged()

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
        return self.master_weights.values()

    def full_master(self) -> torch.Tensor:
        """The whole fp32 master buffer, gathered across the shard group (collective)."""
        if self.layout.num_shards == 1:
            return self.master_values().float()
        full = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        shard = self.master_values().to(self.device, torch.float32)
        self.comm.all_gather(full, shard, self.shard_group)
        return full

    def _new_shard(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.reduce_dtype
        return torch.empty(self.layout.shard_numel, dtype=dtype, device=self.device)

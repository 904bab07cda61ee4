"""`GradientReducer`: decides when each bucket's gradients are reduced during backward.

A post-accumulate-grad hook on every trainable parameter hands its gradient to its
`FlatParamGroup`. When a bucket is complete its reduction is launched asynchronously, so it
overlaps the rest of backward. Buckets are always launched in one fixed order on every rank (a
ready bucket waits for the buckets before it), because collectives must match across ranks even
when data-dependent control flow makes gradients arrive in a different order. At most
``max_inflight_numel`` elements of buckets are in flight (stages 2-3): a launch first waits for
the oldest reductions, since each holds its full-size input and receive buffers until it is done,
and when communication is slower than backward an unbounded queue held the whole gradient twice
over. A callback queued on the autograd engine finishes the pass: it launches buckets that never
filled (unused parameters count as zero gradients), waits for all reductions, and counts the
micro-step. Because the hooks do the work, ``loss.backward()`` and ``engine.backward(loss)``
behave the same.

Without hooks (``hooks=False``: a pipeline schedule, whose micro-batches' backward passes are
its own), gradients accumulate whole in ``.grad`` and `reduce_accumulated` hands them to the
groups and reduces them afterwards, through the same launch order and in-flight bound.
"""

from __future__ import annotations

import functools

import torch

from hf_zero.comm import Collectives
from hf_zero.comm.topology import Group
from hf_zero.sharding.flat_group import FlatParamGroup


class GradientReducer:
    def __init__(
        self,
        groups: list[FlatParamGroup],
        stage: int,
        gradient_accumulation_steps: int,
        overlap_comm: bool,
        control: Group,
        comm: Collectives | None = None,
        max_inflight_numel: int | None = None,
        hooks: bool = True,
    ) -> None:
        self.groups = groups
        self.max_inflight_numel = max_inflight_numel
        self._inflight: list[FlatParamGroup] = []
        # Stages 2-3 buckets reduced by a plain reduce-scatter (not qgZ): their full-size inputs
        # count against max_inflight_numel, their reduced shards are views of one slab per
        # backward and (dtype, device), sized here once.
        sliced = [g for g in groups if stage >= 2 and g.reduce_codec.takes_output]
        # Groups whose master writes each reduced shard out as soon as its reduction is waited
        # for (NVMe: `FlatParamGroup.land_reduce`) take no slab: nothing is kept to the end.
        early = [g for g in sliced if g.master_weights.lands_early]
        sliced = [g for g in sliced if not g.master_weights.lands_early]
        self._bounded = {id(g) for g in sliced + early}
        self._sliced = {id(g) for g in sliced}
        self._slab_numel: dict[tuple, int] = {}
        for g in sliced:
            key = (g.reduce_dtype, g.device)
            self._slab_numel[key] = self._slab_numel.get(key, 0) + g.layout.shard_numel
        self._slabs: dict[tuple, list] = {}  # this backward's output slabs: [tensor, used]
        self.control = control
        self.comm = (comm or Collectives()).for_purpose("control")  # the received-flags max
        self.stage = stage
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.overlap_comm = overlap_comm
        self.micro_steps = 0
        """Backward passes completed since initialisation."""
        self.sync_enabled = True
        """False inside ``no_sync()``: stages 0-1 then accumulate locally without communicating."""
        self._in_backward = False
        self._sync_this_backward = False
        self._next_launch = 0
        self._handles = []
        self.on_backward_end = None
        for group in groups if hooks else []:
            for i, p in enumerate(group.params):
                hook = functools.partial(self._on_grad, group, i)
                self._handles.append(p.register_post_accumulate_grad_hook(hook))

    @property
    def at_boundary(self) -> bool:
        """True when the micro-steps so far complete an accumulation window."""
        return self.micro_steps > 0 and self.micro_steps % self.gradient_accumulation_steps == 0

    def will_sync(self) -> bool:
        """Whether the next backward reduces gradients across ranks."""
        if self.stage >= 2:
            # Stage 2 keeps no full gradients to accumulate locally: it always reduce-scatters
            # and accumulates the shard (no_sync cannot save communication there).
            return True
        boundary = (self.micro_steps + 1) % self.gradient_accumulation_steps == 0
        return self.sync_enabled and boundary

    def _on_grad(self, group: FlatParamGroup, i: int, param: torch.Tensor) -> None:
        if not self._in_backward:
            self._in_backward = True
            self._sync_this_backward = self.will_sync()
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        group.on_grad_ready(i)
        if self._sync_this_backward and self.overlap_comm and group.all_ready:
            self._launch_in_order(only_ready=True)

    def _launch_in_order(self, only_ready: bool) -> None:
        while self._next_launch < len(self.groups):
            group = self.groups[self._next_launch]
            if only_ready and not group.all_ready:
                return
            self._bound_inflight(group.numel)
            output = self._output_for(group) if id(group) in self._sliced else None
            group.launch_reduce(async_op=True, output=output)
            if id(group) in self._bounded:
                self._inflight.append(group)
            self._next_launch += 1

    def _output_for(self, group: FlatParamGroup) -> torch.Tensor:
        """Stages 2-3: the bucket's reduced shard as a view of one slab per backward.

        The shards live from backward to the step, while backward allocates and frees
        transients around them; one slab (allocated once, its pages touched as the shards are
        written, freed whole when the step releases the last of them) kept them from
        fragmenting the heap.
        """
        key = (group.reduce_dtype, group.device)
        if key not in self._slabs:
            numel = self._slab_numel[key]
            self._slabs[key] = [torch.empty(numel, dtype=key[0], device=key[1]), 0]
        slab = self._slabs[key]
        start, slab[1] = slab[1], slab[1] + group.layout.shard_numel
        return slab[0][start : slab[1]]

    def _bound_inflight(self, numel: int) -> None:
        """Wait for the oldest reductions until ``numel`` more fits under the limit (one bucket
        always may go: a bucket larger than the limit waits for the others, then runs alone)."""
        if self.max_inflight_numel is None:
            return
        while self._inflight and (
            sum(g.numel for g in self._inflight) + numel > self.max_inflight_numel
        ):
            oldest = self._inflight.pop(0)
            oldest.wait_reduce()
            oldest.land_reduce()

    def reduce_accumulated(self) -> None:
        """Reduce the gradients accumulated in the parameters' ``.grad`` since the last step,
        as a synced backward's end does (for a reducer built with ``hooks=False``)."""
        if self._handles:
            raise RuntimeError("hf_zero: reduce_accumulated is for a reducer without hooks")
        for group in self.groups:
            for i, p in enumerate(group.params):
                if p.grad is not None:
                    group.on_grad_ready(i)
        self._sync_this_backward = True
        self._finish_backward()

    def _finish_backward(self) -> None:
        if self._sync_this_backward:
            self._launch_in_order(only_ready=False)
            received = self._received_anywhere()
            for group, got in zip(self.groups, received):
                group.finish_reduce(received=got)
        else:
            for group in self.groups:
                group.reset_backward()
        self._next_launch = 0
        self._inflight.clear()
        self._slabs.clear()
        self._in_backward = False
        self.micro_steps += 1
        if self.on_backward_end is not None:
            self.on_backward_end(self._sync_this_backward)

    def _received_anywhere(self) -> list[bool]:
        """Which buckets got a gradient on at least one rank since they were last reduced.

        A bucket no rank touched keeps ``master.grad = None``, so the optimizer skips it, as
        torch skips a parameter whose ``.grad`` is None (DDP with unused parameters).
        """
        flags = torch.tensor([g.received for g in self.groups], dtype=torch.uint8)
        if self.control.size > 1 and len(flags):
            self.comm.all_reduce_max(flags, self.control)
        return [bool(f) for f in flags]

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

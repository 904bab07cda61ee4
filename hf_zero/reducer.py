"""`GradientReducer`: decides when each bucket's gradients are reduced during backward.

A post-accumulate-grad hook on every trainable parameter hands its gradient to its
`FlatParamGroup`. When a bucket is complete its reduction is launched asynchronously, so it
overlaps the rest of backward. Buckets are always launched in one fixed order on every rank (a
ready bucket waits for the buckets before it), because collectives must match across ranks even
when data-dependent control flow makes gradients arrive in a different order. A callback queued on
the autograd engine finishes the pass: it launches buckets that never filled (unused parameters
count as zero gradients), waits for all reductions, and counts the micro-step. Because the hooks
do the work, ``loss.backward()`` and ``engine.backward(loss)`` behave the same.
"""

from __future__ import annotations

import functools

import torch

from hf_zero.comm import Collectives
from hf_zero.flat_group import FlatParamGroup
from hf_zero.topology import Group


class GradientReducer:
    def __init__(
        self,
        groups: list[FlatParamGroup],
        stage: int,
        gradient_accumulation_steps: int,
        overlap_comm: bool,
        control: Group,
        comm: Collectives | None = None,
    ) -> None:
        self.groups = groups
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
        for group in groups:
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
            group.launch_reduce(async_op=True)
            self._next_launch += 1

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

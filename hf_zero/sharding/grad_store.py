"""`GradStore`: where one bucket's reduced gradient lives from its reduction to the optimizer step.

The ZeRO paper counts 16-bit gradients (2 bytes per element held); the optimizer needs fp32 ones.
hf_zero keeps the 16-bit sum the reduction produced and converts it to fp32 only inside the
optimizer step, one bucket at a time (`ShardedOptimizer` steps bucket by bucket then), so no
fp32 gradient the size of a rank's shard is resident:

=========================  =============================================  ====================
case                       held between the reduction and the step        bytes per element
=========================  =============================================  ====================
stage 0, 16 bits           ``flat_grad`` itself (all-reduced in place)    0 beyond flat_grad
stage 1, 16 bits           this rank's region of ``flat_grad`` (the       0 beyond flat_grad
                           reduced shard is copied there, the rest
                           zeroed)
stages 2-3, 16 bits        the reduce-scatter's output shard              2 / N
one micro-batch
stages 2-3, 16 bits, from  an fp32 accumulator: exact sums across the     4 / N (kept on
the 2nd micro-batch of a   accumulation window, freed at the step         purpose)
window
fp32 training, fp32        ``master.grad`` in fp32, averaged in place     as the reduction
communication, qgZ         (stages 0-1: a view of ``flat_grad``)          produced it
offload                    fp32 in host memory (`fold_host` / CPU Adam)   4 / N host
=========================  =============================================  ====================

The 16-bit sum is kept unaveraged; the conversion is ``sum.float().div_(N)``, then the pending
unscale (fp16) and clip factors in the order they were asked for: the same operations, in the same
order, as when the fp32 gradient was made right after the reduction, so the numbers are unchanged.
"""

from __future__ import annotations

import torch


class GradStore:
    """One trainable bucket's reduced gradient: a pending sum, or fp32 in ``master.grad``."""

    def __init__(self, master: torch.nn.Parameter, world: int) -> None:
        self.master = master
        self.world = world
        self.pending: torch.Tensor | None = None
        """The reduced sum, not yet averaged: 16-bit (converted at the step) or stage 1's fp32
        region of ``flat_grad`` (averaged in place when the step begins)."""
        self._divisor = world  # what `pending` must still be divided by (1: already averaged)
        self._factors: list[float] = []  # unscale / clip multipliers still to apply to pending
        self._materialized = False
        self._host: tuple[torch.Tensor, object] | None = None  # offload: a copy in flight

    # --- after a reduction -------------------------------------------------------------------
    def fold(
        self,
        reduced: torch.Tensor,
        accumulate: bool,
        average_now: bool = True,
        averaged: bool = False,
    ) -> None:
        """Take a finished reduction's sum ``reduced``.

        ``accumulate`` (stages 2-3) adds it to what an earlier micro-batch left, in fp32;
        otherwise it replaces it (stages 0-1 reduce the whole window's sum). An fp32 sum is
        averaged in place at once unless ``average_now`` is False (stage 1: ``reduced`` is
        ``flat_grad``'s own region, which must keep the sum while backward may still add to it).
        ``averaged``: ``reduced`` already holds the average (stage 0's 16-bit ``flat_grad``,
        averaged in place as DDP does, so a later synced backward adds to an average).
        """
        self._divisor = 1 if averaged else self.world
        if accumulate and self.present:
            self._promote()  # a second micro-batch: sum exactly, in fp32
            self.master.grad.add_(reduced.to(torch.float32).div_(self.world))
        elif reduced.dtype == torch.float32 and average_now:
            self.master.grad, self.pending = reduced.div_(self._divisor), None
        else:
            self.master.grad, self.pending = None, reduced
        self._factors = []

    def _promote(self) -> None:
        if self.pending is not None:
            self.master.grad, self.pending = self.grad32(), None

    def fold_host(self, host: torch.Tensor, done, accumulate: bool) -> None:
        """Offload: an fp32 host copy of a reduced sum is on its way (``done``: CUDA event)."""
        if accumulate:
            self.land_host()  # the previous micro-batch's copy, if still pending
        else:
            self.master.grad = None  # replaced, as `fold` replaces
        self._host = (host, done)

    def land_host(self) -> None:
        """Offload: once the device-to-host copy has landed, average and accumulate it."""
        if self._host is None:
            return
        grad, self._host = landed_average(self._host, self.world), None
        if self.master.grad is None:
            self.master.grad = grad
        else:
            self.master.grad.add_(grad)

    # --- before and during the step ----------------------------------------------------------
    @property
    def present(self) -> bool:
        return self.pending is not None or self.master.grad is not None

    @property
    def lazy(self) -> bool:
        """True while the gradient is a 16-bit sum that the step must convert."""
        return self.pending is not None

    def settle(self) -> None:
        """When the step begins: land host copies, average an fp32 sum in place (no memory)."""
        self.land_host()
        if self.pending is not None and self.pending.dtype == torch.float32:
            self.master.grad, self.pending = self.pending.div_(self._divisor), None

    def all_finite(self) -> bool:
        held = self.pending if self.pending is not None else self.master.grad
        return held is None or bool(torch.isfinite(held).all())

    def scale_(self, factor: float) -> None:
        """Multiply the gradient (unscale, clip); deferred to the conversion while pending."""
        if self.pending is not None:
            self._factors.append(factor)
        elif self.master.grad is not None:
            self.master.grad.mul_(factor)

    def grad32(self) -> torch.Tensor | None:
        """The fp32 gradient the optimizer would see; a fresh tensor while pending."""
        if self.pending is None:
            return self.master.grad
        grad = self.pending.to(torch.float32, copy=True).div_(self._divisor)
        for factor in self._factors:
            grad.mul_(factor)
        return grad

    def square_sum(self) -> torch.Tensor:
        """Sum of squares of `grad32` (for the global norm), without keeping a conversion."""
        grad = self.grad32()
        return (grad.pow_(2) if self.lazy else grad.float().pow(2)).sum()

    def materialize(self) -> bool:
        """Set ``master.grad`` to the fp32 gradient for the step; False if there is none."""
        if self.pending is not None:
            self.master.grad = self.grad32()
            self.pending, self._factors, self._materialized = None, [], True
        return self.master.grad is not None

    def release(self) -> None:
        """After the bucket's step: free the gradient `materialize` converted."""
        if self._materialized:
            self.master.grad = None
            self._materialized = False

    def clear(self) -> None:
        self.master.grad = self.pending = self._host = None
        self._factors, self._materialized = [], False

    # --- inspection --------------------------------------------------------------------------
    def held_bytes(self, flat_grad: torch.Tensor | None) -> int:
        """Bytes held beyond ``flat_grad`` (views of it are not counted again); in host memory
        when the group offloads."""
        held = [self.pending, self.master.grad, self._host[0] if self._host else None]
        return sum(
            t.numel() * t.element_size()
            for t in held
            if t is not None and not _shares(t, flat_grad)
        )


def landed_average(copy: tuple[torch.Tensor, object], world: int) -> torch.Tensor:
    """Wait for a device-to-host copy ``(host, done)`` (see `start_copy`) and average it over
    ``world`` ranks, in place."""
    host, done = copy
    if done is not None:
        done.synchronize()
    return host.div_(world)


def start_copy(host: torch.Tensor, reduced: torch.Tensor):
    """Start copying ``reduced`` into (pinned) ``host`` memory; the CUDA event that marks the
    copy's end, or None where the copy is already done (CPU)."""
    host.copy_(reduced, non_blocking=True)
    if not reduced.is_cuda:
        return None
    done = torch.cuda.Event()
    done.record()
    return done


def _shares(t: torch.Tensor, buffer: torch.Tensor | None) -> bool:
    return (
        buffer is not None and t.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    )

"""How a group takes in the gradients autograd produces, until its bucket is reduced.

Stages 0-1 (`FlatGrads`, `ScatteredFlatGrads`) keep full gradients in one flat buffer whose views
are the parameters' ``.grad``: autograd accumulates into them across micro-batches, and the
reduction reads the buffer. Stages 2-3 (`BucketGrads`) copy each gradient into the bucket's
reduction input as it arrives and drop ``.grad``: nothing full-size outlives the bucket's
reduction.

Once the reduction has finished, `settle` says what its result is, in one of three forms the
master weights take differently (`hf_zero.sharding.master`).
"""

from __future__ import annotations

import torch

from hf_zero.sharding.layout import FlatLayout

SUM = "sum"
"""The reduced sum in its own buffer: averaged in place (fp32) or at the step (16-bit)."""
OWN_REGION = "own region"
"""Stage 1: the sum kept in ``flat_grad``'s own region, which a later synced backward before the
step adds to: averaged only when the step begins."""
WHOLE_16BIT = "whole 16-bit"
"""Stage 0, 16-bit: the all-reduced ``flat_grad`` itself."""


class FlatGrads:
    """Stage 0: ``flat_grad`` holds the window's gradients (``p.grad`` are views of it) and is
    all-reduced whole."""

    accumulates = False
    """The reductions of a window replace each other (each is the whole window's sum)."""

    def __init__(self, layout: FlatLayout, params: list, dtype: torch.dtype, device) -> None:
        self.layout, self.params = layout, params
        self.flat_grad = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
        self.views = [
            self.flat_grad[slot.offset : slot.end].view(slot.shape) for slot in layout.slots
        ]
        self.point_grads()

    def take(self, i: int, ready: bool) -> None:
        p, view = self.params[i], self.views[i]
        if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
            # Someone reset .grad (e.g. model.zero_grad()); autograd made a fresh tensor.
            view.copy_(p.grad)
            p.grad = view

    def reduction_input(self, reduce_dtype: torch.dtype, ready: list[bool]) -> torch.Tensor:
        g = self.flat_grad
        return g if g.dtype == reduce_dtype else g.to(reduce_dtype)

    def settle(self, reduced: torch.Tensor) -> tuple[torch.Tensor, str]:
        """The finished reduction's result and its form."""
        if reduced is self.flat_grad and reduced.dtype != torch.float32:
            return reduced, WHOLE_16BIT
        return reduced, SUM

    def zero_grad(self) -> None:
        self.flat_grad.zero_()
        self.point_grads()

    def point_grads(self) -> None:
        for p, view in zip(self.params, self.views):
            p.grad = view


class ScatteredFlatGrads(FlatGrads):
    """Stage 1: ``flat_grad`` is reduce-scattered, and this rank keeps the sum in its own region
    of it (``shard``: that region's range) rather than in a second gradient buffer."""

    def __init__(self, layout, params, dtype, device, shard: tuple[int, int]) -> None:
        super().__init__(layout, params, dtype, device)
        self.shard = shard
        self._input: torch.Tensor | None = None

    def reduction_input(self, reduce_dtype: torch.dtype, ready: list[bool]) -> torch.Tensor:
        self._input = super().reduction_input(reduce_dtype, ready)
        return self._input

    def settle(self, reduced: torch.Tensor) -> tuple[torch.Tensor, str]:
        reduced_input, self._input = self._input, None
        if reduced_input is not self.flat_grad:
            return reduced, SUM  # a converted copy was reduced
        # The other regions are zeroed: a later synced backward (DDP-style accumulation) adds
        # to them and to this region, and the next reduction is again the exact total.
        start, end = self.shard
        region = self.flat_grad[start:end].copy_(reduced)
        self.flat_grad[:start].zero_()
        self.flat_grad[end:].zero_()
        return region, OWN_REGION


class BucketGrads:
    """Stages 2-3: each gradient is copied into the bucket's reduction input, then dropped."""

    flat_grad = None
    accumulates = True
    """Each backward's reduction adds to the window's sum so far."""

    def __init__(self, layout: FlatLayout, params: list, reduce_dtype: torch.dtype, device):
        self.layout, self.params = layout, params
        self.reduce_dtype, self.device = reduce_dtype, device
        self.full: torch.Tensor | None = None  # this backward's gradients, reduction input
        self._alone = len(params) == 1 and layout.padded_numel == params[0].numel()

    def take(self, i: int, ready: bool) -> None:
        p = self.params[i]
        grad = p.grad.reshape(-1)
        if self.full is None and self._alone and grad.dtype == self.reduce_dtype:
            # One parameter fills the bucket (a large embedding): reduce its gradient itself.
            # p.grad is cleared below, so autograd never writes into it again.
            self.full = grad
        elif self.full is None:
            # Not zero-filled: each slot's first gradient is copied in, and what no gradient
            # reached is zeroed at launch (a memset and a read saved per bucket).
            self.full = torch.empty(
                self.layout.padded_numel, dtype=self.reduce_dtype, device=self.device
            )
        slot = self.layout.slots[i]
        target = self.full[slot.offset : slot.end]
        if target.data_ptr() == grad.data_ptr():
            pass  # the gradient itself, taken above
        elif ready:
            target.add_(grad)  # a second use in this backward
        else:
            target.copy_(grad)
        p.grad = None  # never keep a full gradient beyond its bucket

    def reduction_input(self, reduce_dtype: torch.dtype, ready: list[bool]) -> torch.Tensor:
        """The full-size input, handed over: the reduction holds it until it is done, so at
        most the buckets in flight are resident at once."""
        full, self.full = self.full, None
        if full is None:
            # No gradient reached this bucket on this rank; other ranks may have some.
            return torch.zeros(self.layout.padded_numel, dtype=reduce_dtype, device=self.device)
        self._zero_unfilled(full, ready)
        return full

    def settle(self, reduced: torch.Tensor) -> tuple[torch.Tensor, str]:
        return reduced, SUM

    def _zero_unfilled(self, flat: torch.Tensor, ready: list[bool]) -> None:
        """Zero what no gradient was copied into this backward: padding and unused slots."""
        end = 0
        for slot, filled in sorted(zip(self.layout.slots, ready), key=lambda x: x[0].offset):
            if filled:
                flat[end : slot.offset].zero_()
                end = slot.end
        flat[end:].zero_()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def grad_intake(
    stage: int, layout: FlatLayout, params: list, dtype, reduce_dtype, shard: tuple[int, int]
) -> FlatGrads | BucketGrads:
    """The intake for a group of ``stage``: ``dtype`` is the parameters', ``reduce_dtype`` the
    reduction's, ``shard`` this rank's range of the buffer."""
    device = params[0].device
    if stage == 0:
        return FlatGrads(layout, params, dtype, device)
    if stage == 1:
        return ScatteredFlatGrads(layout, params, dtype, device, shard)
    return BucketGrads(layout, params, reduce_dtype, device)

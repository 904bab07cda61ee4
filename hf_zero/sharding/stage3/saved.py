"""Saved-tensor hooks that keep autograd from holding released stage-3 weights.

``F.linear`` saves ``weight.t()`` for backward: a view of the unit's gathered flat buffer, not the
parameter. Held by the autograd graph, such a view would keep the whole buffer alive after the
unit is released, so between forward and backward a rank would hold every unit's full parameters
(at 182M fp32 parameters on 2 ranks: 730 MB of the 1.4 GB live) and sharding the parameters
would save nothing at the peak.

While the root module's forward runs, `SavedWeightViews` saves such a view as its place in the
group (offset, sizes, strides) instead, and rebuilds it in backward from the buffer the unit's
backward gather made: the same values (hpZ and qwZ gather what forward used, MixZ++ dequantizes
the same INT8), so gradients are unchanged. A view whose group is not gathered when backward needs
it (a parameter used outside its own unit) is gathered then and released at the end of backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_zero.sharding.flat_group import FlatParamGroup


@dataclass
class _Place:
    group: FlatParamGroup
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class SavedWeightViews:
    """Pack/unpack hooks for the tensors autograd saves during a stage-3 forward."""

    def __init__(self, gather) -> None:
        self._gather = gather  # gathers one group on demand (a collective: backward is in step)
        self._groups: dict[int, FlatParamGroup] = {}  # storage address of flat_param -> group
        self._context: torch.autograd.graph.saved_tensors_hooks | None = None
        self.rebuilt = 0
        """Saved weight views rebuilt in backward (for tests and stats)."""

    def track(self, group: FlatParamGroup) -> None:
        """``group`` has (or is receiving) a gathered ``flat_param``."""
        if group.flat_param is not None:
            self._groups[group.flat_param.untyped_storage().data_ptr()] = group

    def enter(self) -> None:
        """Start saving weight views by place (the root module's forward begins)."""
        self.exit()  # a forward that raised never reached its exit
        self._groups.clear()
        self._context = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._context.__enter__()

    def exit(self) -> None:
        if self._context is not None:
            context, self._context = self._context, None
            context.__exit__(None, None, None)

    def _pack(self, tensor: torch.Tensor):
        group = self._groups.get(tensor.untyped_storage().data_ptr())
        flat = group.flat_param if group is not None else None
        # Only a view of the group's *current* buffer: an address freed and reused by an
        # activation no longer matches a live flat_param's storage.
        if (
            flat is None
            or flat.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()
            or tensor.dtype != flat.dtype
        ):
            return tensor
        return _Place(group, tensor.storage_offset(), tuple(tensor.size()), tuple(tensor.stride()))

    def _unpack(self, packed):
        if not isinstance(packed, _Place):
            return packed
        group = packed.group
        if group.flat_param is None:
            self._gather(group)
        elif group._gather_work is not None:
            group.wait_gather()
        self.rebuilt += 1
        return group.flat_param.as_strided(packed.size, packed.stride, packed.offset)

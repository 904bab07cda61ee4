"""Activation bytes: what autograd keeps for backward, counted as it is saved and as it is freed.

Every tensor autograd saves during a recorded forward passes through a pack hook
(``torch.autograd.graph.saved_tensors_hooks``). The meter counts each distinct storage once, for
as long as any saved reference to it lives: autograd holds a small token per saved tensor, and
the token's death (backward freed it, or the graph was dropped) releases its share. Parameters
are not activations (their bytes are in `memory_report()`), so saved parameters and views of
them (a linear layer saves its weight transposed) are skipped.

Hooks do not nest in torch (only the innermost pair runs), so the meter hands every saved tensor
on to the pair that was active when it entered (stage 3's saved weight views, a user's
``save_on_cpu``): profiling must not change what a run holds. It counts a tensor only when that
pair kept the tensor itself.

Each storage is counted under the **part** of the model that saved it first (``part``): the
profiler names the head and its loss ``logits`` (with the logits tensor itself, `hold`) and the
MLPs ``mlp``, apart from the rest (``activations``), because different mechanisms remove them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch


def _active_hooks() -> tuple[Callable, Callable] | None:
    """The saved-tensor hooks in effect now (torch keeps them on a stack; no public getter)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


class _Saved:
    """What autograd stores instead of the tensor: what the inner hooks packed, how to unpack
    it, and (when counted) a release on death."""

    __slots__ = ("key", "meter", "packed", "unpack")

    def __init__(
        self, packed: Any, unpack: Callable | None, meter: SavedTensorMeter, key: int | None
    ):
        self.packed, self.unpack, self.meter, self.key = packed, unpack, meter, key

    def __del__(self) -> None:
        if self.key is not None:
            self.meter._release(self.key)


REST = "activations"
"""The part of a storage saved outside any `labelled` region."""


class SavedTensorMeter:
    """Bytes of the storages autograd holds for backward, now and at most since `reset_peak`,
    in all and per part (``by_part``, ``peak_by_part``)."""

    def __init__(self) -> None:
        self._refs: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self._parts: dict[int, str] = {}
        self.bytes = 0
        self.peak = 0
        self.by_part: dict[str, int] = {}
        self.peak_by_part: dict[str, int] = {}
        self.part = REST
        """The part new storages are counted as (the profiler's module hooks set it)."""
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._inner: tuple[Callable, Callable] | None = None
        self._entered = False

    @property
    def counting(self) -> bool:
        """Between `enter` and `exit`."""
        return self._entered

    def enter(self) -> None:
        """Count what the forward about to run saves (until `exit`)."""
        if not self._entered:
            self._inner = _active_hooks()
            self._hooks.__enter__()
            self._entered = True

    def exit(self) -> None:
        if self._entered:
            self._hooks.__exit__(None, None, None)
            self._entered = False

    def reset_peak(self) -> None:
        self.peak = self.bytes
        self.peak_by_part = dict(self.by_part)

    def hold(self, tensor: torch.Tensor, part: str) -> None:
        """Count ``tensor``'s storage as ``part`` for as long as the tensor lives, saved or not
        (the logits a forward returns are held by its output, not by autograd)."""
        key = self._acquire(tensor, part)
        if key is not None:
            weakref.finalize(tensor, self._release, key)

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        pack, unpack = self._inner or (None, None)
        packed = pack(tensor) if pack is not None else tensor
        parameter = isinstance(tensor, torch.nn.Parameter) or isinstance(
            tensor._base, torch.nn.Parameter
        )
        if packed is not tensor or parameter or tensor.device.type == "meta":
            return _Saved(packed, unpack, self, None)
        return _Saved(packed, unpack, self, self._acquire(tensor, self.part))

    def _acquire(self, tensor: torch.Tensor, part: str) -> int | None:
        """One more reference to ``tensor``'s storage (counted as ``part`` if new); its key, or
        None for an empty storage, which holds nothing."""
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key == 0:
            return None
        if key not in self._refs:
            self._refs[key] = 0
            self._sizes[key] = size = storage.nbytes()
            self._parts[key] = part
            self.bytes += size
            self.peak = max(self.peak, self.bytes)
            self.by_part[part] = now = self.by_part.get(part, 0) + size
            self.peak_by_part[part] = max(self.peak_by_part.get(part, 0), now)
        self._refs[key] += 1
        return key

    @staticmethod
    def _unpack(saved: _Saved):
        return saved.unpack(saved.packed) if saved.unpack is not None else saved.packed

    def _release(self, key: int) -> None:
        left = self._refs.get(key, 0) - 1
        if left > 0:
            self._refs[key] = left
            return
        self._refs.pop(key, None)
        size = self._sizes.pop(key, 0)
        self.bytes -= size
        part = self._parts.pop(key, REST)
        self.by_part[part] = self.by_part.get(part, 0) - size

"""Activation bytes: what autograd keeps for backward, counted as it is saved and as it is freed.

Every tensor autograd saves during a recorded forward passes through a pack hook
(``torch.autograd.graph.saved_tensors_hooks``). The meter counts each distinct storage once, for
as long as any saved reference to it lives: autograd holds a small token per saved tensor, and
the token's death (backward freed it, or the graph was dropped) releases its share. Parameters
are not activations (their bytes are in `memory_report()`), so saved parameters are skipped.
"""

from __future__ import annotations

import torch


class _Saved:
    """What autograd stores instead of the tensor: the tensor, and a release on death."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, tensor: torch.Tensor, meter: SavedTensorMeter, key: int) -> None:
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self) -> None:
        self.meter._release(self.key)


class SavedTensorMeter:
    """Bytes of the storages autograd holds for backward, now and at most since `reset_peak`."""

    def __init__(self) -> None:
        self._refs: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self.bytes = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._entered = False

    @property
    def counting(self) -> bool:
        """Between `enter` and `exit`."""
        return self._entered

    def enter(self) -> None:
        """Count what the forward about to run saves (until `exit`)."""
        if not self._entered:
            self._hooks.__enter__()
            self._entered = True

    def exit(self) -> None:
        if self._entered:
            self._hooks.__exit__(None, None, None)
            self._entered = False

    def reset_peak(self) -> None:
        self.peak = self.bytes

    def _pack(self, tensor: torch.Tensor):
        if isinstance(tensor, torch.nn.Parameter) or tensor.device.type == "meta":
            return tensor
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key == 0:  # an empty storage holds nothing
            return tensor
        if key not in self._refs:
            self._refs[key] = 0
            self._sizes[key] = storage.nbytes()
            self.bytes += self._sizes[key]
            self.peak = max(self.peak, self.bytes)
        self._refs[key] += 1
        return _Saved(tensor, self, key)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: int) -> None:
        left = self._refs.get(key, 0) - 1
        if left > 0:
            self._refs[key] = left
            return
        self._refs.pop(key, None)
        self.bytes -= self._sizes.pop(key, 0)

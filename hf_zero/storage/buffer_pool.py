"""Whole gathered-parameter buffers kept for reuse between gathers, on CPU runs that unmap.

Stage 3 gathers each unit's full parameters into a fresh buffer and frees it at release, twice a
step. Where large frees are returned to the OS at once (``host_memory: unmap``, the default of
runs whose point is memory: NVMe tiers, ``offload_param``), every gather maps new pages and
faults each of them in: 332M parameters, 2 CPU ranks, ``offload_param``/``offload_optimizer:
cpu`` measured 7.53 s a step against 6.34 s with glibc keeping freed memory (``reuse``), which
in turn peaked 1.1 GB higher (fragments of every size stay in its heap). `BufferPool` keeps up
to two released buffers of each size and dtype for the next gather of that size: the decoder
layers of a model share one size, and a gather in forward or backward takes the buffer the
release of a unit two or three places back gave (measured: 6.27 s a step, peak +28 MB). The
bound keeps a whole-model gather (``model.state_dict()`` under stage 3) from leaving a whole
model's worth of buffers behind.

A buffer is kept only when nothing else still refers to its storage (a view kept by a hook, a
saved tensor): reusing it then would change values someone else reads, so it is freed as
before. `NoPool` is the choice everywhere else (GPUs have a caching allocator; other CPU
settings keep freed memory in glibc's heap or return it by policy).
"""

from __future__ import annotations

import torch


class NoPool:
    """Gathers allocate and releases free, as torch does."""

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, buffer: torch.Tensor) -> None:
        """Nothing kept: dropping the last reference frees it."""

    def held_bytes(self) -> int:
        return 0

    def clear(self) -> None:
        pass


def _storage_refs(buffer: torch.Tensor) -> int | None:
    """How many references the buffer's storage has besides ``buffer`` (None: torch cannot
    say)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    # ``untyped_storage()`` makes one more reference of its own while it is asked.
    return count(buffer.untyped_storage()._cdata) - 2


class BufferPool(NoPool):
    """Released buffers by (numel, dtype, device), up to ``keep_per_size`` of each, handed out
    again by `take`."""

    def __init__(self, keep_per_size: int = 2) -> None:
        self.keep_per_size = keep_per_size
        self._free: dict[tuple, list[torch.Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        kept = self._free.get((numel, dtype, torch.device(device)))
        return kept.pop() if kept else torch.empty(numel, dtype=dtype, device=device)

    def give(self, buffer: torch.Tensor) -> None:
        """Keep ``buffer`` (the caller's last reference) unless something else shares it."""
        if _storage_refs(buffer) != 0 or buffer.storage_offset() or not buffer.is_contiguous():
            return
        kept = self._free.setdefault((buffer.numel(), buffer.dtype, buffer.device), [])
        if len(kept) < self.keep_per_size:
            kept.append(buffer)

    def held_bytes(self) -> int:
        """Bytes of the buffers kept now (``memory_report``'s ``pooled_params``)."""
        return sum(b.numel() * b.element_size() for kept in self._free.values() for b in kept)

    def clear(self) -> None:
        """Free every kept buffer."""
        self._free.clear()

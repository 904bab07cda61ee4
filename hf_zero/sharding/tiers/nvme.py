"""The shard in a swap file (``offload_param: nvme``, ZeRO-Infinity), read ahead on demand, or
also kept in host memory while the rank's budget allows (``offload_param_max_in_cpu``).

Between gathers an uncached shard's bytes are only on disk. `prefetch` starts reading them into an
aligned host buffer on the swap space's I/O threads (the ZeRO-3 coordinator calls it for the next
units of the traced order, ``offload_param.buffer_count`` of them); `fetch` waits for that read
(or starts it) and hands the buffer to the gather, which frees it when done. Writes (the step's
updated tiles) go out asynchronously; a later read of the same file waits for them first.

A cached shard (the first ones built, up to the budget's elements: the model's first units) is
gathered from memory and never read back; its updates are written into the cache and through to
the file, so the file stays the shard's whole truth (checkpoints, resume) and the cache equals it.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import torch

from hf_zero.observe import clock
from hf_zero.sharding.tiers.device import Tier
from hf_zero.storage.host_budget import HostBudget
from hf_zero.storage.swap import ALIGN, SwapFile, SwapSpace


@dataclass
class NvmeParams:
    """What every `NvmeTier` of a rank shares: its swap space and its host-memory budget."""

    space: SwapSpace
    cache: HostBudget


class NvmeTier(Tier):
    """``context`` is the rank's `NvmeParams`."""

    kind = "nvme_params"  # bytes on disk, not in memory

    def __init__(self, values: torch.Tensor, device: torch.device, context: NvmeParams) -> None:
        self.device = device
        self.swap = context.space
        self.numel, self.dtype = values.numel(), values.dtype
        self.itemsize = values.element_size()
        self.file = self.swap.file("param", self.numel * self.itemsize)
        self._read: tuple[torch.Tensor, Future] | None = None
        self._writes: list[Future] = []
        self.cached: torch.Tensor | None = None
        """The shard in host memory (aligned, block-padded), when the budget had room for it."""
        if context.cache.take(self.numel):
            self.cached = self.swap.buffer(self.numel, self.dtype)
        self._copied = None  # CUDA: the event after the last copy out of the cache
        self.shared = False
        """The group's master lives in this file too (`share_with_master`)."""
        self.stats = {"reads": 0, "read_ahead_hits": 0, "cache_hits": 0}
        """Shard fetches for gathers, how many of the disk reads had been started ahead
        (`prefetch`), and how many came from the cache instead."""
        self.write_(values)
        self.flush()

    def prefetch(self) -> None:
        if self._read is None and self.cached is None:
            self.flush()  # never read what an unfinished write is still changing
            buffer = self.swap.buffer(self.numel, self.dtype)
            self._read = (buffer, self.file.read_async(buffer))

    def fetch(self) -> torch.Tensor:
        self.stats["reads"] += 1
        if self.cached is not None:
            self.stats["cache_hits"] += 1
            with clock.phase("copy"):
                local = self.cached.to(self.device, non_blocking=True)  # CPU: the cache itself
            if self.device.type == "cuda":
                self._copied = torch.cuda.Event()
                self._copied.record()
            return local  # gathers only read their shard
        self.stats["read_ahead_hits"] += self._read is not None
        self.prefetch()
        (buffer, done), self._read = self._read, None
        clock.waited("disk_io", done)
        with clock.phase("copy"):
            return buffer.to(self.device, non_blocking=True)

    def write_(self, values: torch.Tensor, start: int = 0, non_blocking: bool = False) -> None:
        self._drop_read()  # its bytes are about to be stale
        per_block = ALIGN // self.itemsize
        lo = start // per_block * per_block
        hi = min(-(-(start + values.numel()) // per_block) * per_block, self.numel)
        edges = lo != start or hi != start + values.numel()
        if self.cached is not None:
            if edges:
                self.flush()  # an edge block may be in a write still in flight
            if self._copied is not None:
                self._copied.synchronize()  # the last gather's copy out of the cache is done
            self.cached[start : start + values.numel()].copy_(values)
            buffer = self.cached[lo:hi]  # aligned: the cache is, and lo is a whole block
        else:
            buffer = self.swap.buffer(hi - lo, self.dtype)
            if edges:
                self.flush()
                with clock.phase("disk_io"):
                    self.file.read(buffer, lo * self.itemsize)  # keep the rest of the edge blocks
            buffer[start - lo : start - lo + values.numel()].copy_(values)
        self._writes.append(self.file.write_async(buffer, lo * self.itemsize))
        if not non_blocking:
            self.flush()

    def share_with_master(self, space: SwapSpace, dtype: torch.dtype) -> SwapFile | None:
        if space is not self.swap or self.dtype != dtype:
            return None  # another disk, or bf16 parameters of an fp32 master: other numbers
        self.shared = True
        return self.file

    def take_step_tile(self, values: torch.Tensor, start: int) -> None:
        if not self.shared:
            return self.write_(values, start, non_blocking=True)
        # The step writes these bytes to this file as the master's; keep the cache equal.
        self._drop_read()
        if self.cached is not None:
            if self._copied is not None:
                self._copied.synchronize()
            self.cached[start : start + values.numel()].copy_(values)

    def flush(self) -> None:
        """Wait for every write started so far."""
        writes, self._writes = self._writes, []
        for done in writes:
            clock.waited("disk_io", done)

    def _drop_read(self) -> None:
        if self._read is not None:
            clock.waited("disk_io", self._read[1])
            self._read = None

    def held_bytes(self) -> dict[str, int]:
        resident = self.numel * self.itemsize if self._read is not None else 0
        cached = self.numel * self.itemsize if self.cached is not None else 0
        on_disk = 0 if self.shared else self.file.nbytes  # counted as the master's
        return {self.kind: on_disk, "host_params": resident + cached}

"""Give freed host memory back to the OS after each optimizer step, when training on CPU, or keep it.

glibc keeps freed heap memory for the process to reuse, and raises its mmap threshold as large
buffers are freed, so after the first steps every gradient buffer, reduction output and optimizer
temporary under 32 MB comes from the heap and stays mapped once freed. Between steps that was
about 550 MB per rank of freed memory still resident (182M fp32 parameters, stage 2, 2 ranks),
which raised each backward's peak by as much. `trim` (glibc's ``malloc_trim(0)``) returns it
once per step, when the step leaves `TRIM_MIN_BYTES` or more free; the pages come back as
backward touches them again. Without glibc it does nothing.

With ZeRO-Infinity's NVMe tiers the point is that the host holds only a working set, so
`unmap_large_frees` goes further: allocations of 1 MiB and more are mapped on their own and
returned to the OS the moment they are freed (measured at 332M parameters, 2 ranks: the RSS
between phases fell from 0.9-1.6 GB to 0.37-0.58 GB per rank, which the trim after the step only
reached at its end). ``host_memory: unmap`` asks for the same on any CPU run: at long sequences
the activations and logits tiles freed during backward otherwise stay in the heap and set the
peak (100M Llama, ZeRO-3, 4 ranks: checkpointing at 2,048 tokens peaked at 1,848 MiB a rank
instead of 1,498; SP 4 with tiling at 4,096 tokens at 1,523 MiB instead of 1,086; measured with
the same threshold set by ``MALLOC_MMAP_THRESHOLD_=1048576``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

from hf_zero.storage.buffer_pool import BufferPool, NoPool


@functools.cache
def _malloc_trim():
    return getattr(libc(), "malloc_trim", None)  # None: not glibc (musl, macOS, Windows)


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The C library, loaded once (None where it cannot be loaded)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc mallopt parameters


def reuse_freed_memory() -> bool:
    """Keep freed memory in the process for the next step (config ``host_memory: reuse``):
    buffers up to 32 MiB (glibc's ceiling for the threshold) come from the heap, which is never
    trimmed. Each stage-3 step allocates and frees the same gathered units, reduction buffers
    and quantized payloads; served from kept pages they skip the page faults that cost a
    released heap its speed (measured ZeRO-3 1.23 -> 0.98 s, ZeRO++ 1.6 -> 1.1 s per step, 2
    nodes x 2 CPU ranks). Process-wide; False where there is no ``mallopt``."""
    mallopt = getattr(libc(), "mallopt", None)
    if mallopt is None:
        return False
    return bool(
        mallopt(M_MMAP_THRESHOLD, 32 << 20)
        and mallopt(M_TRIM_THRESHOLD, (1 << 31) - 1)
        and mallopt(M_TOP_PAD, 64 << 20)
    )


def unmap_large_frees(threshold: int = 1 << 20) -> bool:
    """Serve allocations of ``threshold`` bytes and more by their own mappings (glibc
    ``mallopt(M_MMAP_THRESHOLD)``, which also stops the threshold from rising), so freeing
    them returns the memory at once. Process-wide; False where there is no ``mallopt``."""
    mallopt = getattr(libc(), "mallopt", None)
    return bool(mallopt is not None and mallopt(M_MMAP_THRESHOLD, threshold))


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")
    ]  # fmt: skip


@functools.cache
def _mallinfo2():
    fn = getattr(libc(), "mallinfo2", None)
    if fn is not None:  # None: not glibc, or glibc older than 2.33
        fn.restype = _MallInfo2
    return fn


def heap_info() -> _MallInfo2 | None:
    """glibc's own count of its memory (``mallinfo2()``, every arena; it walks their free
    lists): ``fordblks`` held free, ``hblkhd`` served by ``mmap``, ... None where ``mallinfo2``
    is missing (not glibc, or glibc < 2.33)."""
    fn = _mallinfo2()
    return None if fn is None else fn()


def free_heap_bytes() -> int | None:
    """Bytes glibc's malloc holds free for reuse (`heap_info`'s ``fordblks``); None where
    glibc does not tell."""
    info = heap_info()
    return None if info is None else int(info.fordblks)


TRIM_MIN_BYTES = 16 << 20
"""The freed heap memory below which the step's trim is skipped. A trim costs its time whatever
it returns (consolidating the free lists, then faulting the returned pages in again in the next
step): where a tiny model's step leaves 3-4 MiB free, trimming every step made the steps 5-8%
slower than skipping it (2 CPU ranks, ``benchmarks/bench_host_memory.py``). At this threshold
a rank keeps at most 16 MiB of freed memory between steps; any model whose gradient shard alone
is larger is trimmed every step."""


def trim() -> bool:
    """Return the heap's free pages to the OS; False where there is no ``malloc_trim``."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True


class HostMemoryPolicy:
    """When a CPU run returns freed host memory to the OS, chosen once per engine.

    On a GPU the host holds little between steps and nothing here runs. On CPU the config's
    ``host_memory`` decides: ``release`` trims the heap after each stage-2/3 step that leaves at
    least `TRIM_MIN_BYTES` free in it (the sharded gradients freed there leave the process;
    stages 0-1 keep their gradient buffers, and trimming their few transients would cost the
    next step its page faults: stage 1 measured 1.09x DDP); ``unmap`` also maps every allocation
    of 1 MiB and more on its own, so that what is freed inside a step (activations, logits
    tiles) leaves at once rather than piling up in the heap until the trim (long sequences: the
    peak RSS); ``reuse`` keeps freed memory for the next step. Runs whose point is memory
    (``memory_first``: an NVMe tier, or parameters offloaded) unmap unless ``reuse`` is asked
    for: the host then holds model states and a working set only. ``reuse`` there trades RSS for
    the page faults (332M parameters, ``cpu``/``cpu``, 2 CPU ranks: 6.64 -> 5.04 s a step, peak
    4.6 -> 5.3 GB per rank).
    """

    def __init__(self, on_cpu: bool, setting: str, memory_first: bool, stage: int) -> None:
        self.reuse = on_cpu and setting == "reuse"
        self.unmap = on_cpu and not self.reuse and (memory_first or setting == "unmap")
        self.trim_after_step = on_cpu and stage >= 2 and not self.reuse
        self.pool = BufferPool() if self.unmap else NoPool()
        """Stage 3's gathered buffers: kept for the next gather where frees are unmapped (each
        new buffer would fault all its pages in), else allocated and freed
        (`hf_zero.storage.buffer_pool`)."""

    def start(self) -> None:
        """Before the build: the allocator's settings for the whole run."""
        if self.reuse:
            reuse_freed_memory()
        if self.unmap:
            unmap_large_frees()

    def after_build(self) -> None:
        if self.unmap:
            trim()  # what building the groups freed (the model's own tensors)

    def after_step(self) -> None:
        if not self.trim_after_step:
            return
        free = free_heap_bytes()
        if free is None or free >= TRIM_MIN_BYTES:  # glibc does not tell: trim
            trim()

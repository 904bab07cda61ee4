"""``host_memory: release`` on CPU: the step's trim returns freed heap memory to the OS when
there is enough of it to matter (`hf_zero.storage.host_memory.TRIM_MIN_BYTES`), and is skipped
when there is not, since a trim costs its time whatever it returns."""

import ctypes

import pytest
import torch

from hf_zero.profiling.process_memory import measured_bytes
from hf_zero.storage import host_memory
from hf_zero.storage.host_memory import TRIM_MIN_BYTES, HostMemoryPolicy

CHUNK = 64 << 10  # under glibc's mmap threshold: served from the heap, kept there when freed

pytestmark = pytest.mark.skipif(
    host_memory.free_heap_bytes() is None, reason="needs glibc >= 2.33 (mallinfo2)"
)


def _rss() -> int:
    return measured_bytes(torch.device("cpu"), allocator=False)["rss"]


def _free_on_the_heap(nbytes: int) -> int:
    """Allocate ``nbytes`` in heap chunks, touch every page, free all but the last: that one
    keeps the freed run from joining the heap's top, which glibc would trim by itself. Returns
    it, for the caller to free."""
    libc = host_memory.libc()
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    chunks = [libc.malloc(CHUNK) for _ in range(nbytes // CHUNK + 1)]
    for chunk in chunks:
        ctypes.memset(chunk, 1, CHUNK)
    for chunk in chunks[:-1]:
        libc.free(chunk)
    return chunks[-1]


def test_a_step_that_freed_much_gives_it_back():
    policy = HostMemoryPolicy(on_cpu=True, setting="release", memory_first=False, stage=2)
    before = host_memory.free_heap_bytes()
    guard = _free_on_the_heap(4 * TRIM_MIN_BYTES)
    try:
        assert host_memory.free_heap_bytes() - before >= 3 * TRIM_MIN_BYTES  # glibc counts it
        held = _rss()
        policy.after_step()
        assert held - _rss() >= 2 * TRIM_MIN_BYTES  # and the trim returned it
    finally:
        host_memory.libc().free(guard)


@pytest.mark.parametrize(
    "free, trimmed",
    [(TRIM_MIN_BYTES - 1, False), (TRIM_MIN_BYTES, True), (None, True)],
    ids=["under the threshold", "at it", "glibc does not tell"],
)
def test_the_trim_runs_only_when_enough_is_free(monkeypatch, free, trimmed):
    calls = []
    monkeypatch.setattr(host_memory, "free_heap_bytes", lambda: free)
    monkeypatch.setattr(host_memory, "trim", lambda: calls.append(1) or True)
    HostMemoryPolicy(on_cpu=True, setting="release", memory_first=False, stage=3).after_step()
    assert calls == ([1] if trimmed else [])
    # Stage 1, reuse, and a GPU run never trim.
    for on_cpu, setting, stage in ((True, "release", 1), (True, "reuse", 3), (False, "release", 3)):
        HostMemoryPolicy(on_cpu, setting, False, stage).after_step()
    assert calls == ([1] if trimmed else [])

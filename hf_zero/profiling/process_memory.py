"""What the OS or the device allocator says a process holds: the outside view a profile's
objects are reconciled with."""

from __future__ import annotations

import contextlib
import os

import torch

from hf_zero.storage import host_memory

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def pooled(objects: dict[str, int], device_type: str) -> dict[str, int]:
    """The objects held in the memory `measured_bytes` covers: on CPU every one but swap files
    (host and device are the same memory); on a GPU the device's (not ``host_*``)."""
    if device_type == "cpu":
        return {k: v for k, v in objects.items() if not k.startswith("nvme_")}
    return {k: v for k, v in objects.items() if not k.startswith(("host_", "nvme_"))}


def measured_bytes(
    device: torch.device, peak: bool = False, allocator: bool = True
) -> dict[str, int]:
    """``total``: the bytes the profile's objects are compared with (on CPU the resident set,
    on a GPU the caching allocator's allocated bytes); ``rss`` always; on a GPU also
    ``reserved``; on CPU also ``allocator_free`` (freed memory glibc keeps in the resident set,
    held by no tensor: `hf_zero.storage.host_memory.free_heap_bytes`, where glibc tells;
    ``allocator=False`` skips it, which walks the allocator's free lists).
    ``peak=True``: the highest values since `reset_peak` (VmHWM on CPU)."""
    if device.type == "cuda":
        stat = torch.cuda.max_memory_allocated if peak else torch.cuda.memory_allocated
        reserved = torch.cuda.max_memory_reserved if peak else torch.cuda.memory_reserved
        return {
            "total": stat(device),
            "reserved": reserved(device),
            "rss": _status("VmHWM") if peak else _rss(),
        }
    if peak:
        hwm = _status("VmHWM")
        return {"total": hwm, "rss": hwm}
    rss = _rss()
    free = host_memory.free_heap_bytes() if allocator else None
    out = {"total": rss, "rss": rss}
    return out if free is None else {**out, "allocator_free": free}


def reset_peak(device: torch.device) -> None:
    """Start the peaks of `measured_bytes` from now (VmHWM: Linux's ``clear_refs``)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class PeakWatch:
    """A daemon thread that reads the measured total every ``interval`` seconds and keeps the
    highest reading since `reset` (``high``: its total; ``measured``: all of it), with the
    index of the profile sample taken last before it: so a
    peak between two phase boundaries (an optimizer's temporaries, a gradient in flight) is
    seen, and told with the objects of the boundary before it."""

    def __init__(self, device: torch.device, last_sample, interval: float = 0.01) -> None:
        import threading

        self.device, self.last_sample, self.interval = device, last_sample, interval
        self.high, self.at, self.measured = 0, None, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hf_zero_peak_watch", daemon=True)
        self._thread.start()

    def reset(self) -> None:
        self.high, self.at, self.measured = 0, None, {}

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        import time

        while not self._stop.wait(self.interval):
            with contextlib.suppress(Exception):  # never let watching hurt the run
                total = measured_bytes(self.device, allocator=False)["total"]
                if total > self.high:
                    self.high, self.at = total, (time.perf_counter(), self.last_sample())
                    self.measured = measured_bytes(self.device)

"""Where a step's time goes: a process-wide clock that the layers below the engine report to
while a profile records (`hf_zero.profiling`).

Off (the default) every entry point here is one global lookup that returns at once, so code
that reports to the clock costs nothing measurable when nobody profiles.

On, the training thread's time is split into exclusive phases: a phase entered inside another
is subtracted from the outer one (the optimizer step's gradient-norm all-reduce counts as a
collective wait, not as optimizer time). Only the thread that created the clock is timed:
background exchanges and swap-file workers overlap with the training thread, and what that
thread does not wait for costs the step nothing. Whatever no phase claims is ``compute``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

PHASES = (
    "compute",
    "comm_wait_intra",
    "comm_wait_inter",
    "quantize",
    "copy",
    "disk_io",
    "optimizer",
)
"""What a step's wall time is split into; ``compute`` is the remainder."""

_active: PhaseClock | None = None


class PhaseClock:
    """Seconds per phase on one thread, and listeners told of every phase boundary."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.listeners: list[Callable[[str], None]] = []
        self._thread = threading.get_ident()
        self._stack: list[list] = []  # [phase, start, time spent in nested phases]

    def _mine(self) -> bool:
        return threading.get_ident() == self._thread

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self._mine():
            yield
            return
        frame = [name, time.perf_counter(), 0.0]
        self._stack.append(frame)
        try:
            yield
        finally:
            self._stack.pop()
            elapsed = time.perf_counter() - frame[1]
            self.seconds[name] += elapsed - frame[2]
            self.calls[name] += 1
            if self._stack:
                self._stack[-1][2] += elapsed

    def mark(self, event: str) -> None:
        """A boundary worth a memory sample (a unit entered, a bucket reduced, a step done)."""
        if self._mine():
            for listener in self.listeners:
                listener(event)

    def snapshot(self) -> dict[str, float]:
        return dict(self.seconds)


class _TimedWork:
    """A collective's handle whose ``wait()`` is booked as a collective wait."""

    def __init__(self, work, clock: PhaseClock, phase: str) -> None:
        self._work, self._clock, self._phase = work, clock, phase

    def wait(self, *args, **kwargs):
        with self._clock.phase(self._phase):
            return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._work, name)


def active() -> PhaseClock | None:
    """The recording clock, or None when no profile records."""
    return _active


def start() -> PhaseClock:
    """Start recording on the calling thread (the training thread); the clock."""
    global _active
    _active = PhaseClock()
    return _active


def stop() -> None:
    global _active
    _active = None


def phase(name: str):
    """A context that books its time to ``name`` while a profile records (else a no-op)."""
    clock = _active
    return clock.phase(name) if clock is not None else contextlib.nullcontext()


def timed(name: str):
    """Decorator: the function's time is booked to phase ``name`` while a profile records."""

    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            if _active is None:
                return fn(*args, **kwargs)
            with _active.phase(name):
                return fn(*args, **kwargs)

        return inner

    return wrap


def mark(event: str) -> None:
    clock = _active
    if clock is not None:
        clock.mark(event)


def collective(call: Callable[[], object], inter_node: bool, async_op: bool):
    """Run a collective; its wait (inline, or the handle's ``wait()``) is booked per link."""
    clock = _active
    if clock is None:
        return call()
    name = "comm_wait_inter" if inter_node else "comm_wait_intra"
    if not async_op:
        with clock.phase(name):
            return call()
    work = call()
    return None if work is None else _TimedWork(work, clock, name)


def waited(name: str, future) -> object:
    """``future.result()``, its wait booked to phase ``name``."""
    with phase(name):
        return future.result()

"""A stall watchdog: say, well before the collective timeout, where a rank waits and who is late.

A rank whose peer stopped (swapped out, stuck in I/O, SIGSTOPped) waits inside a collective
until the timeout ends the job, and says nothing meanwhile. The watchdog is a daemon thread that
looks at the main thread's stack once a second (collectives release the GIL while they wait).
When the main thread has been blocked at the same point of a collective (a frame in
``torch.distributed`` or ``hf_zero/comm``) for ``stall_warning_seconds``, it logs once: the
operation, where hf_zero called it (file, line, function; the bucket or unit when the caller is
a `FlatParamGroup`), the step, and which ranks have not arrived. For the last it writes its own
waiting point into the job's key-value store and reads the other ranks' (ranks waiting at the
same point have arrived; the others are stopped or still elsewhere); without a store it says so.
"""

from __future__ import annotations

import contextlib
import linecache
import logging
import sys
import threading
import time
from collections.abc import Callable

logger = logging.getLogger("hf_zero.watchdog")

KEY = "hf_zero/waiting/{rank}"
_COMM_PATHS = ("torch/distributed/", "hf_zero/comm/", "concurrent/futures/", "hf_zero/observe/")
_instance: StallWatchdog | None = None


class StallWatchdog:
    """One per process; `start` creates it or retargets it to a new engine."""

    def __init__(self, seconds: float, rank: int, world: int, step_of: Callable[[], int]):
        self.seconds, self.rank, self.world, self.step_of = seconds, rank, world, step_of
        self.reports = 0
        self._main = threading.main_thread()
        self._stop = threading.Event()
        self._store = _default_store()
        self._thread = threading.Thread(target=self._run, name="hf_zero_watchdog", daemon=True)
        self._thread.start()

    @classmethod
    def start(
        cls,
        seconds: float,
        rank: int,
        world: int,
        step_of: Callable[[], int],
        timeout: float | None = None,
    ) -> StallWatchdog | None:
        """The process's watchdog (None when ``seconds`` is 0: switched off). A warning that
        would come after the collective ``timeout`` ends the job comes at half of it instead."""
        global _instance
        if _instance is not None:
            _instance.stop()
            _instance = None
        if seconds and timeout and seconds >= timeout:
            logger.info(
                "hf_zero: stall_warning_seconds %s >= the collective timeout %s s: warning "
                "after %s s instead", seconds, timeout, max(1.0, timeout / 2),
            )  # fmt: skip
            seconds = max(1.0, timeout / 2)
        if seconds and seconds > 0:
            _instance = cls(seconds, rank, world, step_of)
        return _instance

    def stop(self, wait: float = 0.0) -> None:
        """Stop looking; wait up to ``wait`` seconds for the thread to end."""
        self._stop.set()
        if wait and self._thread is not threading.current_thread():
            self._thread.join(wait)

    def _run(self) -> None:
        state = [None, time.monotonic(), False]  # waiting point, since when, reported
        while not self._stop.wait(min(1.0, self.seconds / 4)):
            self._look(state)

    def _look(self, state: list) -> None:
        """One look at the main thread. The frame is not kept past this call: a frame holds its
        locals alive, and the main thread's temporaries must be freed when it returns."""
        frame = sys._current_frames().get(self._main.ident)
        point = (id(frame), frame.f_lasti) if frame is not None else None
        last, since, reported = state
        now = time.monotonic()
        if point != last:
            if reported:
                self._clear()
            state[:] = [point, now, False]
        elif not reported and now - since >= self.seconds and _in_collective(frame):
            state[2] = True
            with contextlib.suppress(Exception):  # never let reporting hurt the run
                self._report(frame, now - since)

    def _report(self, frame, waited: float) -> None:
        op, caller = _where(frame)
        late = self._late(f"{op} at {caller}")
        self.reports += 1
        logger.warning(
            "hf_zero: rank %d has waited %.0f s in %s, called from %s (step %s); %s",
            self.rank, waited, op, caller, self.step_of(), late,
        )  # fmt: skip

    def _late(self, point: str) -> str:
        if self._store is None:
            return "which ranks have not arrived is unknown (no key-value store)"
        self._store.set(KEY.format(rank=self.rank), point)
        waiting = {}
        for r in range(self.world):
            key = KEY.format(rank=r)
            if self._store.check([key]):
                waiting[r] = self._store.get(key).decode()
        late = [r for r in range(self.world) if waiting.get(r) != point]
        if not late:
            return "every rank waits at the same point"
        return f"ranks {late} have not arrived (stopped, or still elsewhere)"

    def _clear(self) -> None:
        if self._store is not None:
            with contextlib.suppress(Exception):
                self._store.delete_key(KEY.format(rank=self.rank))


def stop_watchdog() -> None:
    """Stop the process's watchdog, if any, and let its thread end (used at exit)."""
    global _instance
    if _instance is not None:
        _instance.stop(wait=2.0)
        _instance = None


def _waits_here(frame) -> bool:
    """The frame is blocked in a C++ wait (``work.wait()``, ``handle.wait()``): no Python frame
    of its own, so the line says it."""
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
    return ".wait(" in line


def _in_collective(frame) -> bool:
    """The main thread's innermost frames are a collective's (or a wait on one)."""
    if _waits_here(frame):
        return True
    depth = 0
    while frame is not None and depth < 8:
        name = frame.f_code.co_filename.replace("\\", "/")
        if any(path in name for path in _COMM_PATHS[:2]):
            return True
        frame, depth = frame.f_back, depth + 1
    return False


def _where(frame) -> tuple[str, str]:
    """(the collective, where hf_zero called it) from the main thread's stack."""
    op, caller = None, None
    if _waits_here(frame):
        op = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        return op, _location(frame)
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        inside_comm = any(path in name for path in _COMM_PATHS)
        named = frame.f_code.co_name != "<lambda>"
        if inside_comm and named and ("torch/distributed/" in name or "hf_zero/comm/" in name):
            op = frame.f_code.co_name  # the outermost collective frame wins
        elif op is not None and not inside_comm:
            caller = _location(frame)
            break
        frame = frame.f_back
    return op or "a collective", caller or "outside hf_zero"


def _location(frame) -> str:
    """``file:line in function``, with the bucket when the frame is a `FlatParamGroup`'s."""
    name = frame.f_code.co_filename.replace("\\", "/")
    where = f"{name.rsplit('/', 1)[-1]}:{frame.f_lineno} in {frame.f_code.co_name}"
    owner = frame.f_locals.get("self")
    if type(owner).__name__ == "FlatParamGroup":
        where += f" (bucket {getattr(owner, 'index', '?')})"
    return where


def _default_store():
    try:
        import torch.distributed as dist

        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None

"""Leave the process as torch expects at exit: process groups destroyed while Python still runs.

Gloo's worker threads can hold the last reference to a finished collective's tensors. When a
program ends without ``destroy_process_group()`` (no Trainer script calls it), those references
are dropped while the interpreter is finalising; the thread cannot take the GIL back and the
process aborts after the script has finished ("terminate called without an active exception",
SIGABRT), so a successful run exits with an error. hf_zero therefore destroys the groups from an
``atexit`` handler, after stopping its stall watchdog. It does not when an uncaught exception
ends the program: a peer may still be inside a collective with this rank, and waiting for it
there would turn a crash into a hang; for the same reason a teardown that has not finished after
`DESTROY_WAIT_S` is left behind. A script that destroys the groups itself is unaffected.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading

import torch.distributed as dist

from hf_zero.comm.watchdog import stop_watchdog

DESTROY_WAIT_S = 10.0
"""How long the exit waits for the groups to close (only a peer stuck in a collective delays it)."""

_registered = False
_uncaught = False


def destroy_groups_at_exit() -> None:
    """Arrange (once per process) for the process groups to be destroyed at a normal exit."""
    global _registered
    if _registered:
        return
    _registered = True
    previous = sys.excepthook

    def note_uncaught(kind, value, traceback) -> None:
        global _uncaught
        _uncaught = True
        previous(kind, value, traceback)

    sys.excepthook = note_uncaught
    atexit.register(_tear_down)


def _tear_down() -> None:
    stop_watchdog()
    if _uncaught or not dist.is_available() or not dist.is_initialized():
        return
    closing = threading.Thread(target=_destroy, name="hf_zero_teardown", daemon=True)
    closing.start()
    closing.join(DESTROY_WAIT_S)
    if closing.is_alive():
        print(
            f"hf_zero: the process groups did not close within {DESTROY_WAIT_S:.0f} s (a peer is "
            "still inside a collective); exiting without them",
            file=sys.stderr,
            flush=True,
        )


def _destroy() -> None:
    with contextlib.suppress(Exception):  # exiting anyway: never turn a clean exit into an error
        dist.destroy_process_group()

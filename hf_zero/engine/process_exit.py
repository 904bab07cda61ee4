"""A training process's interpreter exit without the repeated garbage collections of teardown.

While Python finalizes, it collects garbage several times as it clears modules, and each pass
walks every object still alive. With torch, transformers and the Trainer imported (about half a
million objects), that is about a second of CPU in every rank at the end of every run. Measured
on a 2-core CPU, a 2-rank `accelerate launch` of the LoRA recipe for 2 steps took 0.91x the CPU
time and 0.95x the wall time with this (medians of 6 interleaved pairs).

At exit, `collect_then_freeze` collects once, so that every cycle that is garbage then is freed
and its finalizers run, and then freezes what is left, so that the teardown's passes skip it.
Objects still alive are freed as before, by reference counting as their modules are cleared;
only reference cycles that become unreachable during the teardown itself are left to the
operating system (CPython does not promise to finalize objects that still exist when the
interpreter exits).
"""

from __future__ import annotations

import atexit
import gc

_registered = False


def collect_once_at_exit() -> None:
    """Register `collect_then_freeze` to run at this process's exit (once, however often it is
    called). Exit handlers registered later run before it (``atexit`` runs them in reverse)."""
    global _registered
    if not _registered:
        atexit.register(collect_then_freeze)
        _registered = True


def collect_then_freeze() -> None:
    """Collect all generations once, then move every object left out of the collector's reach."""
    gc.collect()
    gc.freeze()

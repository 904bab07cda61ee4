"""One live run per output folder: ``<output_dir>/.hf_zero-run.json``, held by the saving rank.

Two runs writing checkpoints into one folder overwrite and rotate each other's files. The first
run to start creates the lock file (``O_EXCL``: of two starting at once, one wins); a second
run finds it, sees that its owner still runs, and is refused before it trains, with the owner
named. A lock whose owner has ended (killed, or a restarted round's previous process) is taken
over, with a log line. The lock goes at a normal exit and at SIGTERM; after SIGKILL it stays
until the next run takes it over. An owner on another host cannot be judged from here: the
message says so, and which file to remove once that run is over.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path

from hf_zero.storage.owners import Owner
from hf_zero.storage.swap_folders import remove_on_signal

logger = logging.getLogger(__name__)

LOCK = ".hf_zero-run.json"


class OutputDirBusy(ValueError):
    """Another live run holds the output folder."""


class RunLock:
    """This process's hold on an output folder (see the module docstring)."""

    def __init__(self, folder: Path, owner: Owner) -> None:
        self.folder, self.owner = folder, owner
        self.path = folder / LOCK

    @classmethod
    def acquire(cls, folder: str | os.PathLike) -> RunLock:
        """Hold ``folder`` for this process; raises `OutputDirBusy` naming the live holder."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        lock = cls(folder, Owner.this_process())
        for _ in range(3):  # a stale lock removed by two runs at once: try again
            try:
                fd = os.open(lock.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder, since = read_holder(lock.path)
                if holder == lock.owner:
                    return lock  # this process holds it already (a second train())
                if holder is not None and holder.alive():
                    raise OutputDirBusy(_busy_message(folder, holder, since)) from None
                _take_over(lock.path, holder)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(_record(lock.owner), f)
            atexit.register(lock.release)
            remove_on_signal(lock.release)  # SIGTERM ends a process without atexit
            return lock
        raise OutputDirBusy(f"hf_zero: could not take {lock.path}: other runs keep replacing it")

    def release(self) -> None:
        """Remove the lock file if this process still holds it."""
        holder, _ = read_holder(self.path)
        if holder == self.owner:
            with contextlib.suppress(OSError):
                self.path.unlink()


def read_holder(path: Path) -> tuple[Owner | None, str]:
    """The lock's owner and when it took the folder (``None`` for an unreadable lock)."""
    try:
        record = json.loads(path.read_text())
        return Owner(record["host"], int(record["pid"]), int(record["started"])), record["since"]
    except (OSError, ValueError, KeyError, TypeError):
        return None, ""


def _record(owner: Owner) -> dict:
    return {
        "host": owner.host,
        "pid": owner.pid,
        "started": owner.started,
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv),
    }


def _take_over(path: Path, holder: Owner | None) -> None:
    if holder is None:
        logger.warning("hf_zero: replacing the unreadable run lock %s", path)
    else:
        logger.warning(
            "hf_zero: %s was held by %s, which has ended; this run takes the folder",
            path.parent, holder.describe(),
        )  # fmt: skip
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _busy_message(folder: Path, holder: Owner, since: str) -> str:
    where = (
        f"on another host ({holder.host}); if that run has ended, remove {folder / LOCK}"
        if not holder.on_this_host
        else "stop it, or give this run another --output_dir"
    )
    return (
        f"hf_zero: --output_dir {folder} is in use by another run ({holder.describe()}, "
        f"since {since}): {where}"
    )

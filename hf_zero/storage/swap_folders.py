"""The lifetime of ZeRO-Infinity swap folders beyond a normal exit.

A rank's folder is ``<nvme_path>/hf_zero-swap-<launcher pid>/rank<r>.<host>.<pid>``. `atexit`
removes it on a normal exit or an exception; this module covers the rest:

* SIGTERM (pre-emption, the launcher stopping the ranks after one failed) ends a process
  without running ``atexit``: `remove_on_signal` installs a handler that removes this
  process's folders and then lets the signal do what it would have done.
* SIGKILL cannot be caught: the next run on the host finds the folders whose process is gone
  (`remove_stale`, logged) and removes them before it reserves its own space.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from hf_zero.storage.disk_space import tree_bytes
from hf_zero.storage.owners import pid_alive

logger = logging.getLogger("hf_zero.storage.swap")

RUN_PREFIX = "hf_zero-swap-"
_RANK_DIR = re.compile(r"^rank\d+\.(?:(?P<host>.+)\.)?(?P<pid>\d+)$")
_REMOVING = re.compile(r"^\.removing-(?P<pid>\d+)-")
_open: list[Callable[[], None]] = []
_installed = False


def rank_dir_name(rank: int) -> str:
    """This process's folder name: the host and pid say whether its owner is still alive."""
    return f"rank{rank}.{socket.gethostname()}.{os.getpid()}"


def remove_on_signal(close: Callable[[], None]) -> None:
    """Run ``close`` on SIGTERM too (then the signal's previous handling), as on exit."""
    global _installed
    _open.append(close)
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum, frame):
        for each in list(_open):
            with contextlib.suppress(Exception):
                each()
        if callable(previous):
            previous(signum, frame)
        else:  # the default: end the process by this signal, as it would have
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    _installed = True


def forget(close: Callable[[], None]) -> None:
    with contextlib.suppress(ValueError):
        _open.remove(close)


def remove_stale(root: Path) -> list[Path]:
    """Remove the rank folders under ``root`` left by processes of this host that no longer
    exist (and the run folders of ended launchers once empty); returns what was removed."""
    host = socket.gethostname()
    removed = []
    for run in root.glob(f"{RUN_PREFIX}*"):
        for rank_dir in _entries(run):
            remover = _REMOVING.match(rank_dir.name)
            if remover is not None and not pid_alive(int(remover["pid"])):
                shutil.rmtree(rank_dir, ignore_errors=True)  # a removal that was cut short
                continue
            match = _RANK_DIR.match(rank_dir.name)
            if match is None or match["host"] not in (None, host):
                continue  # not ours to judge: another host's, or not a rank folder
            if pid_alive(int(match["pid"])):
                continue
            # The other ranks of this host look at the same folders at the same time: whoever
            # renames it first removes it, the others skip it.
            claimed = rank_dir.with_name(f".removing-{os.getpid()}-{rank_dir.name}")
            try:
                rank_dir.rename(claimed)
            except OSError:
                continue
            size = _tree_mib(claimed)
            shutil.rmtree(claimed, ignore_errors=True)
            logger.warning(
                "hf_zero: removed %s (%.1f MiB), the swap folder of process %s, which has ended",
                rank_dir, size, match["pid"],
            )  # fmt: skip
            removed.append(rank_dir)
        launcher = run.name.removeprefix(RUN_PREFIX)
        if launcher.isdigit() and pid_alive(int(launcher)):
            continue  # a live run: its ranks may be creating their folders in it right now
        with contextlib.suppress(OSError):
            run.rmdir()
    return removed


def _entries(folder: Path) -> list[Path]:
    try:
        return list(folder.iterdir())
    except OSError:  # removed meanwhile, or not a folder
        return []


def describe_others(root: Path, own: Path) -> str:
    """Other runs' swap folders under ``root`` and their sizes, for a full-disk message."""
    others = [
        f"{d} ({_tree_mib(d):.1f} MiB)"
        for run in sorted(root.glob(f"{RUN_PREFIX}*"))
        if run != own.parent
        for d in _entries(run)
    ]
    if not others:
        return ""
    return "; other swap folders there: " + ", ".join(others[:5])


def _tree_mib(path: Path) -> float:
    return tree_bytes(path) / 2**20

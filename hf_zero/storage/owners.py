"""Which process owns a file or folder, and whether that process still runs.

An owner is a host name, a pid and the process's start time (clock ticks since boot, from
``/proc/<pid>/stat``; 0 where there is no ``/proc``): the start time tells a live owner from a
new process that was given a dead owner's pid. Only owners on this host can be judged.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class Owner:
    host: str
    pid: int
    started: int = 0
    """The process's start time in clock ticks since boot (0: unknown)."""

    @classmethod
    def this_process(cls) -> Owner:
        return cls(socket.gethostname(), os.getpid(), start_ticks(os.getpid()))

    @property
    def on_this_host(self) -> bool:
        return self.host == socket.gethostname()

    def alive(self) -> bool:
        """Whether the owner still runs; an owner on another host counts as alive (unknown)."""
        if not self.on_this_host:
            return True
        if not pid_alive(self.pid):
            return False
        return not self.started or start_ticks(self.pid) in (0, self.started)

    @property
    def name(self) -> str:
        """A folder-name form, read back by `parse`."""
        return f"{self.host}.{self.pid}.{self.started}"

    @classmethod
    def parse(cls, name: str) -> Owner | None:
        host, _, rest = name.rpartition(".")
        host, _, pid = host.rpartition(".")
        if not (host and pid.isdigit() and rest.isdigit()):
            return None
        return cls(host, int(pid), int(rest))

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}"


def pid_alive(pid: int) -> bool:
    """Whether a process of this id exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def start_ticks(pid: int) -> int:
    """The process's start time (field 22 of ``/proc/<pid>/stat``), 0 when unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return 0
    # The command name (field 2) may hold spaces and parentheses: count from the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19]) if len(fields) > 19 else 0

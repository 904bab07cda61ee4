"""Two simulated nodes on one Linux machine: network namespaces joined by a shaped veth link.

Each "node" is a network namespace with its own loopback and one end of a veth pair; ``tc tbf``
on both ends limits each direction of the link to the chosen rate (full duplex, as a real NIC).
Ranks inside a namespace talk over its loopback (the kernel routes traffic to a local address
through ``lo``), so only inter-node traffic crosses the veth and shows in its counters.

Everything made here is removed again: on normal exit, on an exception, on SIGINT / SIGTERM /
SIGHUP, and at interpreter exit. Processes left inside a namespace are killed before it is
deleted. Traffic only ever goes to the two addresses this module assigns.

Needs root (or CAP_NET_ADMIN), ``ip`` and ``tc``; `available` says whether they work here.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

RATES = {"200mbit": 200e6, "1gbit": 1e9, "10gbit": 10e9}


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def available() -> tuple[bool, str]:
    """Whether namespaces can be made here, and if not, why."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return False, "the 'ip' and 'tc' commands (iproute2) are not installed"
    if os.geteuid() != 0:
        return False, "making network namespaces needs root"
    probe = f"hfzprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return False, f"'ip netns add' failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return True, ""


class SimCluster:
    """Two namespaces (``nodes[0]``, ``nodes[1]``) joined by a veth pair, shaped to ``rate``.

    Use as a context manager; `run` starts a command inside a node, `link_bytes` reads the
    counters of node 0's end of the link (bytes in both directions, as ``ip -s link`` shows).
    """

    def __init__(self, rate: str | None = "1gbit") -> None:
        tag = os.getpid() % 100000
        self.nodes = [f"hfz{tag}n0", f"hfz{tag}n1"]
        self.links = [f"hfz{tag}a", f"hfz{tag}b"]
        subnet = f"10.{200 + tag % 50}.{tag // 50 % 250}"
        self.addrs = [f"{subnet}.1", f"{subnet}.2"]
        self.rate = rate
        self._up = False
        self._previous_handlers: dict[int, object] = {}

    # --- life cycle ---------------------------------------------------------------------------
    def __enter__(self) -> SimCluster:
        atexit.register(self.close)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            self._previous_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _on_signal(self, signum, frame) -> None:
        raise SystemExit(f"signal {signum}: tearing the simulated cluster down")

    def _build(self) -> None:
        self._up = True
        for node in self.nodes:
            _ip("netns", "add", node)
            _ip("-n", node, "link", "set", "lo", "up")
        _ip("link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
        for node, link, addr in zip(self.nodes, self.links, self.addrs):
            _ip("link", "set", link, "netns", node)
            _ip("-n", node, "addr", "add", f"{addr}/24", "dev", link)
            _ip("-n", node, "link", "set", link, "up")
        self.shape(self.rate)

    def shape(self, rate: str | None) -> None:
        """Limit each direction of the link to ``rate`` (e.g. ``"1gbit"``); None: unshaped."""
        self.rate = rate
        for node, link in zip(self.nodes, self.links):
            subprocess.run(
                ["tc", "-n", node, "qdisc", "del", "dev", link, "root"],
                capture_output=True,
                timeout=30,
            )
            if rate is None:
                continue
            bits = RATES[rate] if rate in RATES else float(rate)
            # The bucket must hold a whole GSO segment (64 KiB) and a few ms at the rate, or
            # tbf drops what veth hands it in one piece and TCP never reaches the rate.
            burst = max(256 << 10, int(bits / 8 * 0.002))
            subprocess.run(
                ["tc", "-n", node, "qdisc", "add", "dev", link, "root", "tbf",
                 "rate", str(int(bits)), "burst", str(burst), "latency", "100ms"],
                check=True, capture_output=True, timeout=30,
            )  # fmt: skip

    def close(self) -> None:
        """Kill whatever still runs inside the namespaces and delete them (idempotent)."""
        if not self._up:
            return
        self._up = False
        for node in self.nodes:
            pids = _ip("netns", "pids", node, check=False).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.2)
        for node in self.nodes:
            _ip("netns", "del", node, check=False)  # takes its end of the veth pair with it
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers.clear()

    # --- use ----------------------------------------------------------------------------------
    def env(self, node: int) -> dict[str, str]:
        """What a process in ``node`` needs: gloo and the TCP store on the node's link address."""
        return {"GLOO_SOCKET_IFNAME": self.links[node], "OMP_NUM_THREADS": "1"}

    def run(
        self,
        node: int,
        cmd: Sequence[str],
        env: dict[str, str] | None = None,
        log: Path | None = None,
    ) -> subprocess.Popen:
        """Start ``cmd`` inside ``node`` (its own process group); output to ``log``."""
        full_env = {**os.environ, **self.env(node), **(env or {})}
        out = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115
        return subprocess.Popen(
            ["ip", "netns", "exec", self.nodes[node], *cmd],
            env=full_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def run_all(
        self,
        cmds: Sequence[Sequence[str]],
        timeout: float,
        logs: Sequence[Path] | None = None,
        env: dict[str, str] | None = None,
    ) -> list[int]:
        """Run ``cmds[i]`` in node ``i``, all at once; their exit codes. On timeout every process
        is killed and ``TimeoutError`` raised."""
        procs = [self.run(i, cmd, env, logs[i] if logs else None) for i, cmd in enumerate(cmds)]
        deadline = time.monotonic() + timeout
        try:
            for proc in procs:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired as err:
            raise TimeoutError(f"simulated cluster run exceeded {timeout:.0f} s") from err
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        return [p.returncode for p in procs]

    def link_bytes(self) -> int:
        """Bytes through node 0's end of the link so far, both directions (``ip -s link``)."""
        out = _ip("-n", self.nodes[0], "-s", "-j", "link", "show", "dev", self.links[0]).stdout
        stats = json.loads(out)[0]["stats64"]
        return int(stats["rx"]["bytes"]) + int(stats["tx"]["bytes"])


def interface_bytes(name: str) -> int:
    """Received + transmitted bytes of interface ``name`` in this process's namespace
    (``/proc/net/dev``, the counters ``ip -s link`` shows)."""
    for line in Path("/proc/net/dev").read_text().splitlines()[2:]:
        iface, _, rest = line.partition(":")
        if iface.strip() == name:
            fields = rest.split()
            return int(fields[0]) + int(fields[8])
    raise ValueError(f"no interface {name!r} in /proc/net/dev")

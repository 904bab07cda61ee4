"""`make test`'s parallel workers (tests/conftest.py): each runs in a network namespace of its
own with only a loopback interface, up, so that its launches on the launchers' default port and
its loopback counters are its own."""

import os
import subprocess

import pytest


def test_a_worker_has_a_network_of_its_own():
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.skip("runs under parallel workers (`make test`); this run has none")
    mine = os.readlink("/proc/thread-self/ns/net")
    controller = os.readlink(f"/proc/{os.getppid()}/ns/net")  # the pytest that started it
    assert mine != controller  # not the machine's network
    child = subprocess.run(["readlink", "/proc/self/ns/net"], capture_output=True, text=True)
    assert child.stdout.strip() == mine  # what the tests launch inherits it
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True)
    lines = links.stdout.splitlines()
    assert len(lines) == 1 and ": lo:" in lines[0] and "UP" in lines[0], links.stdout

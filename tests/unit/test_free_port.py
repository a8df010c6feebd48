"""free_port() (tests/harness/postgres.py) with the passes of `make test` running at once: a port one
session holds is never given to another, and none is from the range the kernel takes clients' source
ports from (where a client's connection could take a port while a drill has its server stopped)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.harness import postgres
from tests.harness.host import REPO


def test_ports_are_outside_the_kernels_ephemeral_range() -> None:
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = [postgres.free_port() for _ in range(20)]
    assert len(set(ports)) == len(ports)
    assert not [port for port in ports if low <= port <= high]


def test_a_port_another_session_holds_is_not_given_until_it_ends() -> None:
    other = subprocess.Popen([sys.executable, "-c", "from tests.harness.postgres import free_port\n"
                              "print(free_port(), flush=True)\ninput()"],
                             cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(other.stdout.readline())
        assert not postgres._reserve(port)
    finally:
        other.communicate("\n", timeout=30)
    assert postgres._reserve(port)  # the kernel dropped the other session's lock with its process

"""On Debian 13 the package's Recommends, python3-psycopg-c, is what the daemon runs on: psycopg picks its
C implementation by itself when the module is there, and the daemon's `starting` event names the one it
got. Bookworm packages no C build (the daemon there runs the pure-Python one, as `psycopg_impl=python`)."""

from __future__ import annotations

from tests.vm.conftest import SERVICE, VmHost


def test_the_daemon_on_debian_13_runs_psycopgs_c_implementation(vm_host: VmHost) -> None:
    log = vm_host.run("journalctl", "--no-pager", "-o", "cat", "-u", SERVICE).stdout
    starts = [line for line in log.splitlines() if line.startswith("starting ")]
    assert starts, log[-3000:]
    assert "psycopg_impl=c" in starts[-1].split(), starts[-1]

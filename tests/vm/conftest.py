"""The VM tier: one Debian 13 guest (tests/harness/vm.py) per session, set up as the README's Install
says: the .deb built from this checkout, PostgreSQL in the guest, this host's role and DSN, and the
real unitvisor.service. Every test of the tier shares it (a boot costs about a minute of both cores
under software emulation), so each test submits runs of its own and never changes the host."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import _unavailable
from tests.harness import vm as vm_mod
from tests.package.conftest import deb  # noqa: F401 (the session's .deb, built once for both tiers)

HOST_ID = "vm-1"
SERVICE = "unitvisor.service"
SUPERUSER_DSN = "host=/var/run/postgresql dbname=unitvisor"
CONNECT_WITHIN = 180.0
# The runs of this tier are Python one-liners: the one executable they need.
CONFIG = f"""\
[host]
id = "{HOST_ID}"

[runs]
allowed_executables = ["/usr/bin/python3"]
"""


class VmHost:
    """The guest as a unitvisor host: the CLI as root (the host's own DSN) and as the operator."""

    def __init__(self, guest: vm_mod.Guest) -> None:
        self.guest = guest

    def run(self, *cmd: str, check: bool = True, timeout: float = 120) -> vm_mod.Result:
        return self.guest.run(*cmd, check=check, timeout=timeout)

    def cli(self, *cmd: str, check: bool = True, timeout: float = 120) -> vm_mod.Result:
        """A CLI command in the guest. The CLI gives up connecting after 5 s, as it should for a person;
        in a guest under software emulation whose two cores a memory hog and two daemons share, on a
        loaded CI machine, a connection took longer once (CI, test_pressure). A command that could not
        connect did nothing, so it is tried again, as a person would; it fails still, with the CLI's own
        error, when the database stays out of reach for CONNECT_WITHIN seconds."""
        deadline = time.monotonic() + CONNECT_WITHIN
        while True:
            result = self.run(*cmd, check=False, timeout=timeout)
            if (not check or result.returncode == 0 or "cannot connect to the database" not in result.stderr
                    or time.monotonic() > deadline):
                break
            time.sleep(2)
        if check and result.returncode != 0:
            raise vm_mod.VmError(f"in the guest: {result!r}")
        return result

    def unitvisor(self, *args: str, check: bool = True, timeout: float = 120) -> vm_mod.Result:
        return self.cli("unitvisor", *args, check=check, timeout=timeout)

    def operator(self, *args: str, check: bool = True, timeout: float = 120) -> vm_mod.Result:
        """As the operator: the postgres superuser over the local socket, as the README's Install."""
        return self.cli("runuser", "-u", "postgres", "--", "unitvisor", "--dsn", SUPERUSER_DSN, *args,
                        check=check, timeout=timeout)

    def submit(self, *args: str) -> str:
        return self.operator("submit", *args).stdout.strip()

    def show(self, run_id: str) -> dict:
        return json.loads(self.unitvisor("show", run_id, "--json").stdout)

    def wait_ended(self, run_id: str, timeout: float = 300, tail: bool = False) -> dict:
        """The run once it has ended and its attempt's outcome (with the accounting) is recorded, and
        with `tail`, its output's tail too (the daemon reads it from the journal a few seconds after the
        outcome, on a thread of its own)."""
        deadline = time.monotonic() + timeout
        while True:
            shown = self.show(run_id)
            if (shown["state"] not in ("queued", "running") and all(a["outcome"] for a in shown["attempts"])
                    and (not tail or all(a["output_tail"] is not None for a in shown["attempts"]))):
                return shown
            if time.monotonic() > deadline:
                raise AssertionError(f"run {run_id} did not end within {timeout}s: {shown}")
            time.sleep(1)

    def prop(self, unit: str, name: str) -> str:
        return self.run("systemctl", "show", "-P", name, unit).stdout.strip()


@pytest.fixture(scope="session")
def vm_host(deb: Path, request: pytest.FixtureRequest) -> Iterator[VmHost]:  # noqa: F811 (the fixture above)
    """The guest, set up. A guest that dies while being set up (qemu gone: CI once saw the agent's
    socket break during the daemon's first start, with no word of why) is booted once more, and what
    the first one printed goes to the terminal: the tier is about what the kernel enforces, and one
    lost emulator is not a finding about it. A second death fails the tier, with the same report."""
    reason = vm_mod.available()
    if reason:
        _unavailable(reason)
    for boot in (1, 2):
        with vm_mod.Guest() as guest:
            try:
                host = _set_up(guest, deb)
            except vm_mod.GuestGone as gone:
                if boot == 2:
                    raise
                reporter = request.config.pluginmanager.get_plugin("terminalreporter")
                if reporter is not None:
                    reporter.write_line(f"\nthe VM tier's guest died while being set up; booting another:\n{gone}")
                continue
            yield host
            return


def _set_up(guest: vm_mod.Guest, package: Path) -> VmHost:
    """The README's Install in the guest, up to a daemon connected to its database."""
    host = VmHost(guest)
    guest.write("/root/unitvisor.deb", package.read_bytes())
    # Every dependency is in the image already: dpkg needs no network (the guest has none).
    host.run("dpkg", "-i", "/root/unitvisor.deb", timeout=900)
    host.run("runuser", "-u", "postgres", "--", "psql", "-q", "-c", "CREATE ROLE unitvisor LOGIN")
    host.run("runuser", "-u", "postgres", "--", "createdb", "--owner", "unitvisor", "unitvisor")
    host.operator("migrate", timeout=300)
    added = json.loads(host.operator("hosts", "add", HOST_ID, "--db-host", "localhost", "--json").stdout)
    guest.write("/etc/unitvisor/dsn", (added["dsn"] + "\n").encode(), mode=0o600)
    guest.write("/etc/unitvisor/unitvisor.toml", CONFIG.encode(), mode=0o644)
    host.run("systemctl", "restart", SERVICE, timeout=300)
    deadline = time.monotonic() + 180
    while "waiting" in host.prop(SERVICE, "StatusText") or host.prop(SERVICE, "ActiveState") != "active":
        if time.monotonic() > deadline:
            raise AssertionError(f"the daemon did not connect: {host.prop(SERVICE, 'StatusText')}")
        time.sleep(1)
    return host

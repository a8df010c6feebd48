"""The fleet of tests/harness/fleet.py: three test beds side by side on one PostgreSQL, each its own
machine; one loses power and comes back; a proxied one is cut off; nothing is left behind."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import _unavailable
from tests.harness import testbed as testbed_mod
from tests.harness.fleet import Fleet, Member, servers
from tests.harness.host import wait_for


@pytest.fixture
def fleet_dsn(dsn: str) -> str:
    reason = testbed_mod.available()
    if reason:
        _unavailable(reason)
    testbed_mod.cleanup_stale()
    return dsn


def boot_id(member: Member) -> str:
    return member.tb.run("cat", "/proc/sys/kernel/random/boot_id").stdout.strip()


def nothing_left(dirs: list[Path], namespaces: list[str]) -> None:
    mounts = Path("/proc/mounts").read_text()
    for path in dirs:
        assert not path.exists(), path
        assert not Path(f"{path}.log").exists() and not Path(f"{path}.owner").exists(), path
        assert str(path) not in mounts, path
    for namespace in namespaces:
        assert not testbed_mod._namespace_members(namespace), f"processes left in {namespace}"


def test_three_hosts_one_power_cut_and_back(fleet_dsn: str) -> None:
    with Fleet(fleet_dsn, size=3, proxied=[3], config_extra="\n# appended to each\n") as fleet:
        print(f"booted 3 test beds in {fleet.boot_seconds:.2f} s")
        dirs = [member.tb.dir for member in fleet]
        namespaces = [testbed_mod._pid_namespace(member.tb.leader) for member in fleet]
        assert [m.tb.name for m in fleet] == ["uv-fleet-1", "uv-fleet-2", "uv-fleet-3"]
        assert [m.host_id for m in fleet] == ["fleet-1", "fleet-2", "fleet-3"]

        machine_ids = [member.machine_id() for member in fleet]
        assert len(set(machine_ids)) == 3
        assert Path("/etc/machine-id").read_text().strip() not in machine_ids
        for member in fleet:
            config = member.tb.run("cat", "/etc/unitvisor/unitvisor.toml").stdout
            assert f'id = "{member.host_id}"' in config and config.endswith("\n# appended to each\n")
            assert member.tb.run("cat", "/etc/unitvisor/dsn").stdout.strip() == member.dsn
            assert member.boots() and len(member.boots()) == 1

        # Only the third goes through a proxy; from inside its container the CLI reaches the database.
        assert fleet[0].dsn == fleet[1].dsn == fleet_dsn and not fleet[0].proxies
        assert f"port={fleet[2].proxy.port}" in fleet[2].dsn
        fleet[2].host.cli("hosts")
        fleet[2].cut("reset")
        assert fleet[2].host.cli("hosts", check=False).returncode != 0
        fleet[0].host.cli("hosts")  # the others are not cut off
        fleet[2].heal()
        fleet[2].host.cli("hosts")

        victim = fleet[1]
        boot_before = boot_id(victim)
        victim.tb.write("/var/lib/before-the-cut", "on the disk\n")
        victim.power_cut()
        assert not victim.tb.running
        assert not testbed_mod._namespace_members(namespaces[1]), "a process of the host survived its power cut"
        for other in (fleet[0], fleet[2]):
            assert other.tb.run("systemctl", "is-system-running", check=False).stdout.strip() in ("running", "degraded")

        victim.boot()
        assert victim.machine_id() == machine_ids[1]
        assert victim.tb.run("cat", "/var/lib/before-the-cut").stdout == "on the disk\n"
        # A new boot, which the journal records. Not "the journal lists two boots": a power cut may
        # lose all that journald had not yet written of the first one (a loaded CI machine showed it).
        boot_after = boot_id(victim)
        assert boot_after != boot_before
        wait_for(lambda: victim.boots() and victim.boots()[-1] == boot_after.replace("-", ""), timeout=30,
                 what="journalctl --list-boots to show the new boot")
        namespaces.append(testbed_mod._pid_namespace(victim.tb.leader))
        proxy_threads = [proxy._thread for member in fleet for proxy in member.proxies]
    nothing_left(dirs, namespaces)
    assert not any(thread.is_alive() for thread in proxy_threads)


def test_per_host_config_text_and_ids(fleet_dsn: str) -> None:
    # Built, not booted: what each host would be given.
    fleet = Fleet(fleet_dsn, size=2, host_ids=["a", "b"], configs={"b": "[host]\nid = \"a\"\n"}, config_extra="#x\n")
    try:
        assert fleet.by_id("a").config.endswith("#x\n") and 'id = "a"' in fleet.by_id("a").config
        assert fleet.by_id("b").config == '[host]\nid = "a"\n'  # a duplicate host id, as a drill would set
    finally:
        fleet.destroy()
    nothing_left([member.tb.dir for member in fleet], [])


def test_power_cut_then_destroy_and_stale_cleanup_of_an_orphaned_container(fleet_dsn: str) -> None:
    """destroy() after a power cut without a new boot; and cleanup_stale() after a session died
    having killed only nspawn, which leaves the container's systemd running, orphaned."""
    cut = testbed_mod.Testbed("uv-cut-1", binds=[])
    orphan = testbed_mod.Testbed("uv-orphan-1", binds=[])
    try:
        cut.boot()
        orphan.boot()
        cut.power_cut()
        cut.destroy()
        nothing_left([cut.dir], [])

        namespace = testbed_mod._pid_namespace(orphan.leader)
        assert orphan.proc is not None
        os.kill(orphan.proc.pid, 9)
        orphan.proc.wait(timeout=10)
        assert testbed_mod._namespace_members(namespace), "the container died with nspawn after all"
        gone = subprocess.Popen(["true"])
        gone.wait()
        orphan.owner_path.write_text(str(gone.pid))  # as if its test session had died
        testbed_mod.cleanup_stale()
        wait_for(lambda: not testbed_mod._namespace_members(namespace), timeout=10, what="the orphan to be killed")
        nothing_left([orphan.dir], [namespace])
    finally:
        orphan.proc = None
        cut.destroy()
        orphan.destroy()


def test_a_proxied_host_gets_a_proxy_per_server_of_a_multi_host_dsn(fleet_dsn: str) -> None:
    dsn = "host=127.0.0.1,127.0.0.1 port=5001,5002 dbname=x user=postgres target_session_attrs=read-write"
    fleet = Fleet(dsn, size=2, proxied=[1])
    try:
        member = fleet[0]
        assert [p.target for p in member.proxies] == [("127.0.0.1", 5001), ("127.0.0.1", 5002)]
        ports = ",".join(str(p.port) for p in member.proxies)
        assert servers(member.dsn) == [("127.0.0.1", p.port) for p in member.proxies]
        assert f"port={ports}" in member.dsn and "target_session_attrs=read-write" in member.dsn
        assert fleet[1].dsn == dsn
        with pytest.raises(AttributeError):
            _ = member.proxy  # two of them: .proxies
        member.cut("blackhole")
        assert all(p.mode == "blackhole" for p in member.proxies)
        member.heal()
    finally:
        fleet.destroy()
    assert not any(p._thread.is_alive() for p in member.proxies)

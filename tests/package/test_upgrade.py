"""A rolling upgrade across a schema change, in the order README.md's Upgrade section gives: two clean-room hosts on
one PostgreSQL run the previous release (0.10.0, schemas 001 to 015, 017 to 024, 026 to 030 and 032 to 035) with
runs in flight; the new version's `unitvisor migrate` (from the new .deb, unpacked, not installed) applies the later
migrations under them; then one host is upgraded, then the other. At every step both daemons claim and finish new
runs; at the end every run succeeded with exactly one attempt, whose unit systemd started once, none is missing, and
both daemons report the new version.

The steps are the tests of this module, in order, on the same two hosts.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor import __version__, store
from tests.conftest import _unavailable
from tests.harness import cleanroom, testbed
from tests.harness.cleanroom import Cleanroom
from tests.harness.host import REPO, wait_for
from tests.package.test_cleanroom import ALLOWED, DB_PASSWORD, SERVICE, Host, say

PREVIOUS_RELEASE = "9e01b0c"  # 0.10.0: schemas 001 to 015, 017 to 024, 026 to 030 and 032 to 035
PREVIOUS_VERSION = "0.10.0"
PREVIOUS_SCHEMA = ("001_schema", "002_fleet", "003_run_policy", "004_roles", "005_sql_api", "006_lifecycle",
                   "007_outcome_record", "008_retention", "009_claim_cost", "010_wake_targets",
                   "011_commit_wake_cost", "012_expiry_owner", "013_fleet_promises", "014_host_reads",
                   "015_run_privilege", "017_accounting", "018_admission_pressure", "019_fleet_upkeep",
                   "020_claim_gate", "021_operator", "022_argument_checks", "023_refusals_now",
                   "024_drain_through_stop", "026_graceful_stop", "027_failure_rules", "028_schedules",
                   "029_heartbeat_cost", "030_hold_freeze", "032_concurrency_limits", "033_placement",
                   "034_river", "035_dependencies")
# Long enough to be in flight from before the migration until after the second host's upgrade
# (12 to 22 s on the 2-core test machine, but 65 s once on a loaded one; in_flight_untouched fails if
# it was not). The last step waits for them to end, so this is also what the module's run costs.
IN_FLIGHT_SECONDS = 150
NEW_CLI = "/tmp/unitvisor-new"  # where the new .deb is unpacked on host 1 for the migration


class Fleet:
    def __init__(self, hosts: list[Host], old_deb: str, new_deb: str) -> None:
        self.hosts = hosts
        self.old_deb = old_deb
        self.new_deb = new_deb
        self.db = hosts[0].room  # the PostgreSQL both use
        self.in_flight: dict[str, dict] = {}  # run id -> {host, unit, invocation}
        self.quick: dict[str, Host] = {}  # run id -> the host it was pinned to
        self.submitted: list[str] = []
        self.in_flight_since = 0.0

    def submit(self, host: Host, *argv: str) -> str:
        """From host 1 (any host would do), pinned to `host`: which host runs what is the test's to say."""
        run_id = self.hosts[0].unitvisor("submit", "--host", host.room.machine_id, "--", *argv).stdout.strip()
        self.submitted.append(run_id)
        return run_id

    def each_host_runs_a_new_run(self) -> None:
        """Both daemons work: a run pinned to each is claimed there and succeeds."""
        runs = {self.submit(h, "/bin/sh", "-c", f"echo claimed on {h.room.machine_id}"): h for h in self.hosts}
        self.quick.update(runs)
        for run_id, host in runs.items():
            waited = self.hosts[0].unitvisor("wait", run_id, "--timeout", "90s", check=False, timeout=120)
            assert waited.returncode == 0, f"run {run_id} on {host.room.tb.name}: {waited.stdout}{waited.stderr}\n" \
                                           f"{host.daemon_log()}"
            assert host.show(run_id)["attempts"][0]["host"] == host.room.machine_id

    def in_flight_untouched(self) -> None:
        for run_id, run in self.in_flight.items():
            host = run["host"]
            assert host.prop(run["unit"], "ActiveState") == "active", \
                f"run {run_id} is no longer running, {time.monotonic() - self.in_flight_since:.0f}s after it started " \
                f"(if it just ended: raise IN_FLIGHT_SECONDS, {IN_FLIGHT_SECONDS})"
            assert host.prop(run["unit"], "InvocationID") == run["invocation"], f"run {run_id} was started again"
            data = host.show(run_id)
            assert data["state"] == "running" and len(data["attempts"]) == 1, data


def daemon_ready_since(host: Host, old_invocation: str) -> str:
    """Wait for a new invocation of the daemon that has connected and reconciled; return its id."""
    wait_for(lambda: host.prop(SERVICE, "ActiveState") == "active"
             and host.prop(SERVICE, "InvocationID") != old_invocation, timeout=90, what="the daemon to be back")
    daemon = host.prop(SERVICE, "InvocationID")
    wait_for(lambda: re.search(r"^ready ", host.run("journalctl", f"_SYSTEMD_INVOCATION_ID={daemon}", "-o", "cat",
                                                     "--no-pager", check=False).stdout, re.M),
             timeout=90, what="the new daemon to be ready")
    return daemon


@pytest.fixture(scope="module")
def old_deb(request: pytest.FixtureRequest) -> Path:
    return cleanroom.release_deb(REPO, PREVIOUS_RELEASE, log=lambda line: say(request, line))


@pytest.fixture(scope="module")
def fleet(deb: Path, old_deb: Path, request: pytest.FixtureRequest) -> Iterator[Fleet]:
    reason = cleanroom.available()
    if reason:
        _unavailable(reason)
    testbed.cleanup_stale()
    cleanroom.ensure_image(log=lambda line: say(request, line))
    with Cleanroom("uv-upgrade-1") as room1, Cleanroom("uv-upgrade-2", postgres=False) as room2:
        hosts = []
        for room in (room1, room2):
            for path in (old_deb, deb):
                shutil.copy(path, room.tb.root / "root" / path.name)
            hosts.append(Host(room, f"/root/{deb.name}"))
        assert room1.machine_id != room2.machine_id
        yield Fleet(hosts, f"/root/{old_deb.name}", f"/root/{deb.name}")


def test_two_hosts_run_the_previous_release(fleet: Fleet, request: pytest.FixtureRequest) -> None:
    started = time.monotonic()
    for host in fleet.hosts:
        host.room.apt_get("install", fleet.old_deb)
        assert f"version {PREVIOUS_VERSION}" in host.unitvisor("--version").stdout
    fleet.db.psql(f"CREATE ROLE unitvisor LOGIN PASSWORD '{DB_PASSWORD}'")
    fleet.db.psql("CREATE DATABASE unitvisor OWNER unitvisor")
    dsn = f"postgresql://unitvisor:{DB_PASSWORD}@127.0.0.1:{fleet.db.pg_port}/unitvisor"
    for host in fleet.hosts:
        host.run("sh", "-c", "umask 077 && cat > /etc/unitvisor/dsn", input=dsn + "\n")
        host.run("sed", "-i", f"s|^# allowed_executables = \\[\\]$|allowed_executables = {ALLOWED}|",
                 "/etc/unitvisor/unitvisor.toml")
    # 0.8.0's Install (as 0.6.0's; an empty database gets schema.sql): migrate as the postgres superuser
    # over the local socket (004 creates roles). The database's owner, the role both hosts log in as
    # here, becomes a member of unitvisor_admin: the single-role deployment that every release keeps
    # working.
    superuser = ("runuser", "-u", "postgres", "--", "unitvisor", "--dsn",
                 f"host=/var/run/postgresql port={fleet.db.pg_port} dbname=unitvisor")
    assert fleet.hosts[0].run(*superuser, "migrate", timeout=120).stdout.strip() == \
        f"applied: {', '.join(PREVIOUS_SCHEMA)}"
    for host in fleet.hosts:
        old = host.prop(SERVICE, "InvocationID")
        host.run("systemctl", "restart", SERVICE, timeout=120)
        daemon_ready_since(host, old)
    fleet.each_host_runs_a_new_run()
    say(request, f"two hosts on {PREVIOUS_VERSION}, configured and working, in {time.monotonic() - started:.1f}s")


def test_both_hosts_have_runs_in_flight(fleet: Fleet) -> None:
    fleet.in_flight_since = time.monotonic()
    for host in fleet.hosts:
        for _ in range(2):
            run_id = fleet.submit(host, "/bin/sleep", str(IN_FLIGHT_SECONDS))
            unit = host.running(run_id)["attempts"][0]["unit"]
            fleet.in_flight[run_id] = {"host": host, "unit": unit, "invocation": host.prop(unit, "InvocationID")}
    fleet.in_flight_untouched()


def test_the_new_versions_migrate_applies_the_new_migrations_under_the_old_daemons(fleet: Fleet) -> None:
    """README: migrate first, with the new version's CLI, from the new .deb unpacked on any host (its
    dependencies are the old version's; nothing is installed). No old daemon notices."""
    h1 = fleet.hosts[0]
    daemons = [h.prop(SERVICE, "InvocationID") for h in fleet.hosts]
    h1.run("dpkg-deb", "-x", fleet.new_deb, NEW_CLI)
    new_cli = ("env", f"PYTHONPATH={NEW_CLI}/usr/share/unitvisor", "python3", "-m", "supervisor")
    assert f"version {__version__}" in h1.run(*new_cli, "--version").stdout
    new = [version for version, _ in store.migration_files() if version not in PREVIOUS_SCHEMA]
    assert new, "this release has no migration of its own: the test would prove nothing about one"
    # As the hosts' own role, a member of unitvisor_admin: from 0.3.0 on, no migration needs a superuser
    # (README, Upgrade; store.migrate applies them under SET ROLE unitvisor_admin).
    assert h1.run(*new_cli, "migrate", timeout=120).stdout.strip() == f"applied: {', '.join(new)}"
    assert h1.run(*new_cli, "migrate").stdout.strip() == "schema is current; nothing to apply"
    h1.run("rm", "-rf", NEW_CLI)
    fleet.each_host_runs_a_new_run()
    fleet.in_flight_untouched()
    assert [h.prop(SERVICE, "InvocationID") for h in fleet.hosts] == daemons, "a daemon restarted"
    assert [h.prop(SERVICE, "NRestarts") for h in fleet.hosts] == ["0", "0"]


def upgrade(fleet: Fleet, index: int, request: pytest.FixtureRequest) -> None:
    host = fleet.hosts[index]
    old = host.prop(SERVICE, "InvocationID")
    started = time.monotonic()
    host.room.apt_get("install", fleet.new_deb)
    daemon_ready_since(host, old)
    say(request, f"host {index + 1} upgraded to {__version__} and ready in {time.monotonic() - started:.1f}s")
    assert f"version {__version__}" in host.unitvisor("--version").stdout
    fleet.in_flight_untouched()
    fleet.each_host_runs_a_new_run()
    hosts = {h["id"]: h for h in json.loads(host.unitvisor("hosts", "--json").stdout)}
    for other in fleet.hosts:
        row = hosts[other.room.machine_id]
        assert (row["state"], row["display_state"]) == ("active", "active"), row
    fleet.in_flight_untouched()


def test_upgrading_host_1_leaves_both_daemons_working(fleet: Fleet, request: pytest.FixtureRequest) -> None:
    upgrade(fleet, 0, request)


def test_upgrading_host_2_leaves_both_daemons_working(fleet: Fleet, request: pytest.FixtureRequest) -> None:
    upgrade(fleet, 1, request)


def test_every_run_ran_exactly_once_and_succeeded(fleet: Fleet, request: pytest.FixtureRequest) -> None:
    h1 = fleet.hosts[0]
    say(request, f"the in-flight runs were in flight through both upgrades: "
                 f"{time.monotonic() - fleet.in_flight_since:.0f}s of their {IN_FLIGHT_SECONDS}s so far")
    for run_id in fleet.in_flight:
        waited = h1.unitvisor("wait", run_id, "--timeout", f"{IN_FLIGHT_SECONDS + 60}s", check=False,
                              timeout=IN_FLIGHT_SECONDS + 90)
        assert waited.returncode == 0, f"{run_id}: {waited.stdout}{waited.stderr}"
    listed = json.loads(h1.unitvisor("runs", "--json", "--limit", "1000").stdout)
    assert sorted(r["id"] for r in listed) == sorted(fleet.submitted), "a run is missing, or one appeared"
    ran_on = {run_id: run["host"] for run_id, run in fleet.in_flight.items()} | fleet.quick
    for run_id in fleet.submitted:
        host = ran_on[run_id]
        data = host.show(run_id)
        assert data["state"] == "succeeded", data
        assert [(a["attempt"], a["outcome"], a["host"]) for a in data["attempts"]] == \
            [(1, "success", host.room.machine_id)], data
        unit = data["attempts"][0]["unit"]
        # PID 1 started the run's unit once, ever, on the host it was pinned to and on no other.
        for other in fleet.hosts:
            started = other.run("journalctl", "-o", "json", "--no-pager", "_PID=1", f"UNIT={unit}").stdout
            invocations = {json.loads(line).get("INVOCATION_ID") for line in started.splitlines()} - {None}
            assert len(invocations) == (1 if other is host else 0), (run_id, other.room.tb.name, invocations)
    versions = fleet.db.psql("SELECT string_agg(version, ',') FROM unitvisor.hosts", database="unitvisor")
    assert versions == f"{__version__},{__version__}"
    for host in fleet.hosts:
        assert host.prop(SERVICE, "NRestarts") == "0"

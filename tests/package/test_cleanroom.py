"""The .deb on a bare Debian 12 host, the way a user meets it: a minimal bookworm made with
debootstrap (cached), PostgreSQL in it, booted with systemd-nspawn (tests/harness/cleanroom.py).

The tests are the steps of one story and run in order on one host: install with apt, which pulls
the dependencies from Debian; the service waits for a database; configure it as the README's
Install section says; run something; restart and reinstall with a run in flight; purge.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import _unavailable
from tests.harness import cleanroom, testbed
from tests.harness.cleanroom import Cleanroom
from tests.harness.host import REPO, wait_for
from tests.harness.postgres import free_port

# systemd-analyze security's overall exposure for the installed unit (0 best, 10 worst). What is
# left is what talking to PID 1 and to PostgreSQL needs (the comments in units/unitvisor.service say
# which); a change that raises it must raise this too, on purpose.
MAX_EXPOSURE = 1.9
DB_PASSWORD = "clean-room-secret"
ALLOWED = '["/bin/sh", "/bin/sleep", "/usr/bin/*"]'
SERVICE = "unitvisor.service"
# A file the run waits for (in /etc: a run has a private /tmp and a read-only root, but may read /etc).
GATE = "/etc/unitvisor-test-gate"
HOST_ID = "web-1"  # README's Install: `unitvisor hosts add web-1`, and [host] id = "web-1"
# The admin's login role, the operator's DSN for submit (the host's own role may not submit).
OPERATOR_DSN = "postgresql://unitvisor:" + DB_PASSWORD + "@localhost:{port}/unitvisor"


def say(request: pytest.FixtureRequest, text: str) -> None:
    """Straight into the test log: pytest's capture would show it only for a failure."""
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if capture is None:
        print(text)
        return
    with capture.global_and_fixture_disabled():
        print(f"\n{text}", flush=True)


class Host:
    """The booted clean room with the package's path in it, and an operator's helpers."""

    def __init__(self, room: Cleanroom, deb: str) -> None:
        self.room = room
        self.deb = deb

    def run(self, *cmd: str, check: bool = True, timeout: float = 60,
            input: str | None = None) -> subprocess.CompletedProcess:
        return self.room.run(*cmd, check=check, timeout=timeout, input=input)

    def prop(self, unit: str, name: str) -> str:
        return self.run("systemctl", "show", unit, f"--property={name}", "--value").stdout.strip()

    def unitvisor(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        result = self.run("unitvisor", *args, check=False, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"unitvisor {' '.join(args)} exited {result.returncode}: {result.stderr.strip()}\n"
                                 f"{self.daemon_log()}")
        return result

    def show(self, run_id: str) -> dict:
        return json.loads(self.unitvisor("show", run_id, "--json").stdout)

    def daemon_log(self) -> str:
        return self.run("journalctl", "-u", SERVICE, "--no-pager", "-o", "cat", "-n", "60", check=False).stdout

    def running(self, run_id: str) -> dict:
        """Wait until the run's first attempt is running under systemd; return its show data."""
        unit = f"unitvisor-run-{run_id}-1.service"
        wait_for(lambda: self.show(run_id)["state"] == "running" and self.prop(unit, "ActiveState") == "active",
                 timeout=60, what=f"run {run_id} to be running")
        return self.show(run_id)


@pytest.fixture(scope="module")
def host(deb: Path, request: pytest.FixtureRequest) -> Iterator[Host]:
    reason = cleanroom.available()
    if reason:
        _unavailable(reason)
    testbed.cleanup_stale()
    started = time.monotonic()
    image = cleanroom.ensure_image(log=lambda line: say(request, line))
    with Cleanroom() as room:
        say(request, f"clean room {image.name} ready and booted in {time.monotonic() - started:.1f}s")
        shutil.copy(deb, room.tb.root / "root" / deb.name)
        yield Host(room, f"/root/{deb.name}")


@pytest.fixture(scope="module")
def long_run(host: Host) -> dict:
    """A run that outlives the restart and the reinstall below, seen running before either."""
    run_id = host.unitvisor("submit", "--dsn", OPERATOR_DSN.format(port=host.room.pg_port), "--",
                            "/bin/sleep", "600").stdout.strip()
    data = host.running(run_id)
    unit = data["attempts"][0]["unit"]
    return {"id": run_id, "unit": unit, "invocation": host.prop(unit, "InvocationID")}


def assert_still_running_and_adopted(host: Host, run: dict, old_daemon: str) -> None:
    """The daemon was restarted (a new invocation), came back, and has the run as it was: the same
    unit, the same systemd invocation (never started again), one attempt."""
    wait_for(lambda: host.prop(SERVICE, "ActiveState") == "active", timeout=90, what="the daemon to be back")
    daemon = host.prop(SERVICE, "InvocationID")
    assert daemon != old_daemon, "the daemon was not restarted"
    # Adopted: the new daemon reconciled (it logs `ready` after that pass) and counts the run as its own.
    wait_for(lambda: re.search(r"^ready ", host.run("journalctl", f"_SYSTEMD_INVOCATION_ID={daemon}", "-o", "cat",
                                                     "--no-pager", check=False).stdout, re.M),
             timeout=60, what="the new daemon to be ready")
    wait_for(lambda: "runs in flight: 1," in host.prop(SERVICE, "StatusText"), timeout=60,
             what="the daemon to count the run in flight")
    assert host.prop(run["unit"], "ActiveState") == "active"
    assert host.prop(run["unit"], "InvocationID") == run["invocation"]
    # PID 1 started the run's unit once, ever.
    started = host.run("journalctl", "-o", "json", "--no-pager", "_PID=1", f"UNIT={run['unit']}").stdout
    assert {json.loads(line).get("INVOCATION_ID") for line in started.splitlines()} - {None} == {run["invocation"]}
    data = host.show(run["id"])
    assert data["state"] == "running"
    assert [a["attempt"] for a in data["attempts"]] == [1]


def test_apt_installs_it_with_its_dependencies_and_it_waits_for_a_database(host: Host,
                                                                          request: pytest.FixtureRequest) -> None:
    started = time.monotonic()
    host.room.apt_get("install", host.deb)
    say(request, f"apt-get install {Path(host.deb).name} (with its dependencies) took "
                 f"{time.monotonic() - started:.1f}s")
    for dep in ("python3-psycopg", "python3-pystemd", "python3-sdnotify", "python3-click", "python3-prometheus-client"):
        assert "install ok installed" in host.run("dpkg-query", "-W", "-f=${Status}", dep).stdout
    assert host.run("systemctl", "is-enabled", SERVICE).stdout.strip() == "enabled"
    # No DSN yet: active, not crash-looping, and saying what it waits for.
    assert not (host.room.tb.root / "etc/unitvisor/dsn").exists()
    wait_for(lambda: "waiting for a database" in host.prop(SERVICE, "StatusText"), timeout=60,
             what="the status to say it is waiting for a database")
    assert host.prop(SERVICE, "ActiveState") == "active"
    assert host.prop(SERVICE, "NRestarts") == "0"
    status = host.run("systemctl", "status", SERVICE, "--no-pager", check=False).stdout
    assert "Status: \"waiting for a database" in status, status


def test_systemd_reads_the_restart_policy_as_the_unit_comments_promise(host: Host) -> None:
    """The installed unit as PID 1 loaded it (test_units.py checks the file's arithmetic): restarts for
    ever, 10 s apart, with no start limit that could leave the host failed."""
    shown = host.run("systemctl", "show", SERVICE, "--property=Restart,RestartUSec,StartLimitIntervalUSec,"
                     "StartLimitAction").stdout
    props = dict(line.split("=", 1) for line in shown.splitlines() if "=" in line)
    assert props == {"Restart": "always", "RestartUSec": "10s", "StartLimitIntervalUSec": "0",
                     "StartLimitAction": "none"}, shown


def test_the_autopkgtest_smoke_test_passes(host: Host) -> None:
    smoke = (REPO / "debian" / "tests" / "smoke").read_text()
    result = host.run("sh", "-c", "mkdir -p /tmp/smoke && AUTOPKGTEST_TMP=/tmp/smoke sh -s", input=smoke,
                      check=False, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_systemd_analyze_security_exposure(host: Host, request: pytest.FixtureRequest) -> None:
    result = host.run("systemd-analyze", "security", "--no-pager", SERVICE, check=False)
    match = re.search(r"Overall exposure level for unitvisor\.service: ([0-9.]+) (\w+)", result.stdout)
    assert match, result.stdout + result.stderr
    say(request, f"systemd-analyze security {SERVICE}: overall exposure {match.group(1)} {match.group(2)}\n"
                 + "\n".join(line for line in result.stdout.splitlines() if line.startswith("✗")))
    assert float(match.group(1)) <= MAX_EXPOSURE


def test_configured_as_the_readme_says_it_runs_a_run(host: Host) -> None:
    host.room.psql(f"CREATE ROLE unitvisor LOGIN PASSWORD '{DB_PASSWORD}'")  # createuser --pwprompt
    host.room.psql("CREATE DATABASE unitvisor OWNER unitvisor")
    # migrate and hosts add as the postgres superuser over the local socket, as README's Install does
    superuser = ("runuser", "-u", "postgres", "--", "unitvisor", "--dsn",
                 f"host=/var/run/postgresql port={host.room.pg_port} dbname=unitvisor")
    assert "applied" in host.run(*superuser, "migrate", timeout=120).stdout
    host.room.psql("REVOKE CONNECT ON DATABASE unitvisor FROM PUBLIC; GRANT CONNECT ON DATABASE unitvisor TO "
                   "unitvisor_admin, unitvisor_submitter, unitvisor_host", database="unitvisor")
    added = json.loads(host.run(*superuser, "hosts", "add", HOST_ID, "--db-host", "localhost", "--json").stdout)
    host.run("sh", "-c", "umask 077 && cat > /etc/unitvisor/dsn", input=added["dsn"] + "\n")
    assert host.run("stat", "-c", "%a %U", "/etc/unitvisor/dsn").stdout.split() == ["600", "root"]
    host.run("sed", "-i", "-e", f"s|^# allowed_executables = \\[\\]$|allowed_executables = {ALLOWED}|",
             "-e", f'0,/^# id = ""$/s||id = "{HOST_ID}"|', "/etc/unitvisor/unitvisor.toml")
    config = host.run("cat", "/etc/unitvisor/unitvisor.toml").stdout
    assert f"allowed_executables = {ALLOWED}" in config and f'\nid = "{HOST_ID}"\n' in config
    host.run("systemctl", "restart", SERVICE, timeout=120)
    wait_for(lambda: "waiting" not in host.prop(SERVICE, "StatusText"), timeout=30, what="a database connection")
    doctor = host.unitvisor("doctor", check=False)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert re.search(rf"^ok\s+role\s+host, bound to {HOST_ID}$", doctor.stdout, re.M), doctor.stdout
    # The host's own role may not submit: the operator's DSN (the admin's login role) does.
    refused = host.unitvisor("submit", "--", "/bin/true", check=False)
    assert refused.returncode == 1 and "it needs unitvisor_submitter" in refused.stderr, refused.stderr

    run_id = host.unitvisor("submit", "--dsn", OPERATOR_DSN.format(port=host.room.pg_port), "--memory", "64M",
                            "--", "/bin/sh", "-c", "echo hello from the clean room; "
                            f"while [ ! -e {GATE} ]; do sleep 0.2; done").stdout.strip()
    unit = host.running(run_id)["attempts"][0]["unit"]
    status = host.run("systemctl", "status", unit, "--no-pager", check=False).stdout
    assert unit in status and "transient" in status and "Active: active" in status, status
    host.run("touch", GATE)  # the run ends when the test says, not after a sleep a loaded machine outruns
    assert host.unitvisor("wait", run_id, "--timeout", "60s").returncode == 0
    assert run_id in host.daemon_log()
    runs = host.unitvisor("runs").stdout
    assert re.search(rf"^{run_id[:8]}\s+succeeded\b", runs, re.M), runs
    assert "hello from the clean room" in host.unitvisor("logs", run_id).stdout


def test_the_packaged_daemon_serves_its_metrics(host: Host) -> None:
    """Debian's python3-prometheus-client under the shipped unit's hardening, configured by uncommenting
    the example config's line. On a free port: the clean room shares this machine's network, where
    other test beds' daemons may hold the default one."""
    port = free_port()
    host.run("sed", "-i", f's|^# listen = "127.0.0.1:9863"$|listen = "127.0.0.1:{port}"|',
             "/etc/unitvisor/unitvisor.toml")
    assert f'listen = "127.0.0.1:{port}"' in host.run("cat", "/etc/unitvisor/unitvisor.toml").stdout
    host.run("systemctl", "restart", SERVICE, timeout=120)
    scrape = ("import sys, urllib.request; "
              "sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())")

    def metrics() -> str:
        result = host.run("python3", "-c", scrape, f"http://127.0.0.1:{port}/metrics", check=False)
        return result.stdout if result.returncode == 0 else ""
    text = wait_for(lambda: (t := metrics()) and "unitvisor_database_up 1.0" in t and t, timeout=60,
                    what="the packaged daemon's metrics with its database up")
    assert 'unitvisor_build_info{version="' in text
    assert 'unitvisor_host_state{state="active"} 1.0' in text
    assert "metrics-listening" in host.daemon_log()


def test_restarting_the_daemon_leaves_a_run_running_and_adopted(host: Host, long_run: dict) -> None:
    daemon = host.prop(SERVICE, "InvocationID")
    host.run("systemctl", "restart", SERVICE, timeout=120)
    assert_still_running_and_adopted(host, long_run, daemon)


def test_reinstalling_the_package_restarts_the_daemon_and_leaves_the_run(host: Host, long_run: dict) -> None:
    daemon = host.prop(SERVICE, "InvocationID")
    host.room.apt_get("install", "--reinstall", host.deb)
    assert_still_running_and_adopted(host, long_run, daemon)
    # The administrator's edits of the conffile survive it.
    assert f"allowed_executables = {ALLOWED}" in host.run("cat", "/etc/unitvisor/unitvisor.toml").stdout


def test_it_lives_side_by_side_with_debians_supervisor(host: Host, long_run: dict) -> None:
    """Debian's `supervisor` (supervisord) owns the public Python name `supervisor`: ours is private."""
    host.room.apt_get("install", "--no-install-recommends", "supervisor")
    assert host.run("python3", "-c", "import supervisor.supervisord").returncode == 0
    assert "unitvisor, version" in host.unitvisor("--version").stdout
    daemon = host.prop(SERVICE, "InvocationID")
    host.run("systemctl", "restart", SERVICE, timeout=120)
    assert_still_running_and_adopted(host, long_run, daemon)


def test_remove_refuses_while_a_run_is_in_flight(host: Host, long_run: dict) -> None:
    """A removal would leave the run unrecorded, and another host would run it again once this one
    is declared dead (issue 21): the prerm refuses, in one line that says how to drain and wait, and
    leaves the package and the daemon as they were. (Failed on the old package: the remove went
    through.)"""
    result = host.room.run("apt-get", "-y", "-q", "remove", "unitvisor", check=False, timeout=300,
                           env={"DEBIAN_FRONTEND": "noninteractive"})
    assert result.returncode != 0, result.stdout
    refusal = [line for line in (result.stdout + result.stderr).splitlines() if "refusing to remove" in line]
    assert len(refusal) == 1 and "unitvisor drain" in refusal[0] and "UNITVISOR_REMOVE_WITH_RUNS=1" in refusal[0], \
        result.stdout + result.stderr
    assert host.run("dpkg-query", "-W", "-f=${Status}", "unitvisor").stdout.strip() == "install ok installed"
    assert host.prop(SERVICE, "ActiveState") == "active"
    assert host.prop("unitvisor-fence.service", "ActiveState") == "active"
    assert host.prop(long_run["unit"], "ActiveState") == "active"


def test_remove_keeps_the_configuration_and_purge_leaves_no_file_behind(host: Host, long_run: dict) -> None:
    files = host.run("dpkg", "-L", "unitvisor").stdout.split()
    # Forced, as the refusal says: the run is left running, unrecorded (asserted at the end).
    host.room.run("apt-get", "-y", "-q", "remove", "unitvisor", timeout=300,
                  env={"DEBIAN_FRONTEND": "noninteractive", "UNITVISOR_REMOVE_WITH_RUNS": "1"})
    assert f"allowed_executables = {ALLOWED}" in host.run("cat", "/etc/unitvisor/unitvisor.toml").stdout
    assert host.run("stat", "-c", "%a", "/etc/unitvisor/dsn").stdout.strip() == "600"
    assert host.run("test", "-e", "/usr/bin/unitvisor", check=False).returncode != 0
    assert host.prop(SERVICE, "ActiveState") == "inactive"
    # The runs are not the daemon's: removing it stops none (they end on their own, or by systemctl
    # stop), and the slice they are in stays while they run.
    assert host.prop(long_run["unit"], "ActiveState") == "active"
    assert host.prop("unitvisor.slice", "ActiveState") == "active"
    host.run("systemctl", "stop", long_run["unit"], timeout=120)
    host.room.apt_get("purge", "unitvisor")
    left = [path for path in files if host.run("test", "-e", path, check=False).returncode == 0
            and host.run("test", "-d", path, check=False).returncode != 0]
    assert not left, f"files of the package left after purge: {left}"
    for path in ("/etc/unitvisor", "/usr/share/unitvisor", "/usr/share/doc/unitvisor",
                 "/etc/systemd/system/multi-user.target.wants/unitvisor.service"):
        assert host.run("test", "-e", path, check=False).returncode != 0, f"{path} is left after purge"
    assert host.prop(SERVICE, "LoadState") == "not-found"
    assert host.prop("unitvisor-fence.service", "LoadState") == "not-found"
    # Once no run is in it, the purge stops the slice too, and PID 1 forgets its file. (Failed before:
    # it stayed active, loaded from the file that was gone.) A slice is loaded by any name, file or
    # not (systemd-run --slice=), so `systemctl show` says `loaded` either way; what is left is a name.
    assert (host.prop("unitvisor.slice", "ActiveState"), host.prop("unitvisor.slice", "FragmentPath")) == (
        "inactive", "")

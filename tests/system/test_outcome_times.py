"""Issue 12, under a real systemd: an attempt's start and end are systemd's own times, not the time the
daemon happened to notice (a run that ends while the daemon is down does not grow by the downtime)."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import pytest

from tests.harness.host import VENV_BIN, Host, wait_for


@pytest.fixture
def started(host: Host) -> Host:
    host.start()
    return host


def unit_time(host: Host, unit: str, prop: str) -> datetime:
    """A timestamp property of a unit, with its microseconds (`systemctl show --timestamp=us+utc`)."""
    out = host.tb.run("systemctl", "show", unit, f"--property={prop}", "--value", "--timestamp=us+utc").stdout.strip()
    # "Mon 2026-11-30 13:39:08.123456 UTC"
    return datetime.strptime(out, "%a %Y-%m-%d %H:%M:%S.%f UTC").replace(tzinfo=UTC)


def attempt_times(host: Host, run_id: str) -> tuple[datetime, datetime]:
    [attempt] = host.show(run_id)["attempts"]
    return datetime.fromisoformat(attempt["started_at"]), datetime.fromisoformat(attempt["ended_at"])


def test_run_that_ends_while_the_daemon_is_down_keeps_its_real_end(started: Host) -> None:
    run_id = started.submit("--", "/bin/sh", "-c", "sleep 2; exit 7")
    unit = f"unitvisor-run-{run_id}-1.service"
    wait_for(lambda: started.show(run_id)["state"] == "running", what="the run to be running")
    started.stop()
    wait_for(lambda: started.unit_props(unit, "ActiveState")["ActiveState"] == "failed", what="the run to end")
    real_start = unit_time(started, unit, "ExecMainStartTimestamp")
    real_end = unit_time(started, unit, "ExecMainExitTimestamp")
    time.sleep(6)  # the daemon stays down well after the run ended
    restarted = datetime.now(UTC)
    started.start()
    data = started.wait_run(run_id)
    [attempt] = data["attempts"]
    assert (attempt["outcome"], attempt["exit_status"]) == ("exit-code", "exit:7")
    recorded_start, recorded_end = attempt_times(started, run_id)
    assert abs((recorded_end - real_end).total_seconds()) < 1.0, (recorded_end, real_end)
    assert (restarted - recorded_end).total_seconds() > 5, "ended_at is the daemon's restart, not the run's end"
    # The start was recorded when the unit was created, a moment after systemd forked it.
    assert abs((recorded_start - real_start).total_seconds()) < 1.0, (recorded_start, real_start)
    assert 1.5 < (recorded_end - recorded_start).total_seconds() < 3.5


def test_run_that_ends_after_the_daemon_crashed_keeps_its_real_end(started: Host) -> None:
    # kill -9 instead of a clean stop: the unit ends while nobody watches, and is settled on restart.
    run_id = started.submit("--", "/bin/sh", "-c", "sleep 1; exit 3")
    unit = f"unitvisor-run-{run_id}-1.service"
    wait_for(lambda: started.unit_props(unit, "ActiveState")["ActiveState"] in ("active", "failed"),
             what="the unit to exist")
    started.kill()
    wait_for(lambda: started.unit_props(unit, "ActiveState")["ActiveState"] == "failed", what="the run to end")
    real_end = unit_time(started, unit, "ExecMainExitTimestamp")
    time.sleep(5)
    started.start()
    started.wait_run(run_id)
    _, recorded_end = attempt_times(started, run_id)
    assert abs((recorded_end - real_end).total_seconds()) < 1.0, (recorded_end, real_end)


@pytest.mark.parametrize(("props", "argv", "expected"), [
    ([], ["/bin/sh", "-c", "exit 203"], "True"),                               # the command's own 203
    (["-p", "WorkingDirectory=/no/such/dir"], ["/bin/true"], "False"),        # CHDIR, 200
    (["-p", "User=no-such-user-here"], ["/bin/true"], "False"),               # USER, 217
])
def test_journal_tells_a_commands_exit_from_a_setup_failure(host: Host, props, argv, expected) -> None:
    """The journal half of the evidence (supervisor.journal.exec_evidence) against PID 1's real records."""
    unit = "unitvisor-probe-exec.service"
    host.tb.run("systemd-run", "--no-block", "-q", "-u", unit, "-p", "Type=exec", "-p", "RemainAfterExit=yes",
                *props, *argv)
    wait_for(lambda: host.unit_props(unit, "ActiveState")["ActiveState"] == "failed", what="the unit to fail")
    inv = host.unit_props(unit, "InvocationID")["InvocationID"]
    code = f"from supervisor.journal import Journal; print(Journal().exec_evidence({unit!r}, {inv!r}))"
    try:
        assert host.tb.run(str(VENV_BIN / "python"), "-c", code).stdout.strip() == expected
    finally:
        host.tb.run("systemctl", "reset-failed", unit, check=False)

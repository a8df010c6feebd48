"""Failure drills: the daemon killed at named points, restarted with runs active, the host rebooted,
the database gone for 30 s, systemd reloaded and re-executed. Each is really done, then the database
and systemd are checked to agree."""

from __future__ import annotations

import time

import pytest

from tests.harness.host import Host, daemon_active, journal_invocations, wait_for
from tests.harness.postgres import Postgres


def running(host: Host, run_id: str) -> bool:
    return host.show(run_id)["state"] == "running"


@pytest.mark.parametrize("point", ["after-claim", "after-start", "before-outcome"])
def test_killed_at_point_then_restarted_runs_exactly_once(host: Host, point: str) -> None:
    host.install_units({"UNITVISOR_FAULT": point})
    host.tb.run("systemctl", "start", "--no-block", "unitvisor.service")
    run_id = host.submit("--", "/bin/sh", "-c", "sleep 1; exit 4")
    unit = f"unitvisor-run-{run_id}-1.service"
    wait_for(lambda: daemon_active(host) in ("failed", "inactive"), timeout=30, what=f"the daemon to die at {point}")
    assert host.unit_props("unitvisor.service", "ExecMainStatus")["ExecMainStatus"] == "9"  # SIGKILL
    host.tb.run("systemctl", "reset-failed", "unitvisor.service", check=False)
    host.start()  # no fault now
    data = host.wait_run(run_id)
    assert data["state"] == "failed"
    [attempt] = data["attempts"]
    assert (attempt["outcome"], attempt["exit_status"]) == ("exit-code", "exit:4")
    assert len(journal_invocations(host, unit)) == 1, "the unit was started more than once"
    wait_for(lambda: not host.loaded_run_units(), what="the unit to be released")


def test_killed_in_the_middle_of_a_reconcile_pass(host: Host) -> None:
    host.start()
    runs = [host.submit("--", *host.gated(f"mid-{n}", exit_code=n)) for n in (0, 5, 6)]
    for run_id in runs:
        wait_for(lambda r=run_id: running(host, r), what="runs to be running")
    host.stop()
    host.install_units({"UNITVISOR_FAULT": "mid-reconcile"})
    host.tb.run("systemctl", "start", "--no-block", "unitvisor.service")
    wait_for(lambda: daemon_active(host) in ("failed", "inactive"), timeout=30, what="the daemon to die mid-pass")
    host.tb.run("systemctl", "reset-failed", "unitvisor.service", check=False)
    host.start()
    host.open_gate("mid-0", "mid-5", "mid-6")
    results = [host.wait_run(run_id) for run_id in runs]
    assert [r["attempts"][0]["exit_status"] for r in results] == ["exit:0", "exit:5", "exit:6"]
    for run_id, data in zip(runs, results, strict=True):
        assert len(data["attempts"]) == 1
        assert len(journal_invocations(host, f"unitvisor-run-{run_id}-1.service")) == 1


def test_restart_with_twenty_runs_active_interrupts_none(host: Host) -> None:
    host.start()
    runs = [host.submit("--", *host.gated("twenty")) for _ in range(20)]
    wait_for(lambda: all(running(host, r) for r in runs), timeout=60, what="20 runs to be running")
    host.tb.run("systemctl", "restart", "unitvisor.service")
    host.open_gate("twenty")
    for run_id in runs:
        data = host.wait_run(run_id, timeout=60)
        assert data["state"] == "succeeded", data
        assert len(data["attempts"]) == 1
        assert len(journal_invocations(host, f"unitvisor-run-{run_id}-1.service")) == 1


def test_host_reboot_loses_running_runs_and_respawns_by_policy(host: Host) -> None:
    host.start()
    retried = host.submit("--max-attempts", "2", "--", "/bin/sleep", "300")
    single = host.submit("--count-lost", "--", "/bin/sleep", "300")  # lost counts: one attempt, no respawn (027)
    ended = host.submit("--", *host.gated("reboot", exit_code=9))
    for run_id in (retried, single, ended):
        wait_for(lambda r=run_id: running(host, r), what="runs to be running")
    host.stop()  # the daemon is down when `ended` ends, so only the journal knows its outcome
    host.open_gate("reboot")
    unit = f"unitvisor-run-{ended}-1.service"
    wait_for(lambda: host.unit_props(unit, "ActiveState")["ActiveState"] == "failed", what="the run to end")
    host.tb.reboot()
    assert host.loaded_run_units() == []  # transient units do not survive a reboot
    host.start()
    data = host.wait_run(single)
    assert (data["state"], data["attempts"][0]["outcome"]) == ("failed", "lost")
    data = host.wait_run(ended)
    assert (data["state"], data["attempts"][0]["outcome"], data["attempts"][0]["exit_status"]) == \
        ("failed", "exit-code", "exit:9")
    assert "journal" in data["attempts"][0]["reason"]
    data = wait_for(lambda: (d := host.show(retried)) and len(d["attempts"]) == 2 and d, timeout=60,
                    what="the retried run's second attempt")
    assert data["attempts"][0]["outcome"] == "lost"
    assert data["attempts"][1]["outcome"] is None
    host.cli("cancel", retried)
    host.wait_run(retried)


def test_database_outage_of_thirty_seconds(host: Host, postgres: Postgres) -> None:
    host.start()
    runs = [host.submit("--", *host.gated(f"outage-{n}", exit_code=n)) for n in range(3)]
    for run_id in runs:
        wait_for(lambda r=run_id: running(host, r), what="runs to be running")
    postgres.stop_server()
    host.open_gate(*(f"outage-{n}" for n in range(3)))  # they end while the database is away
    try:
        status = wait_for(lambda: "database" in (s := host.unit_props("unitvisor.service", "StatusText")
                                                 .get("StatusText", "")) and s, timeout=20,
                          what="STATUS= to name the database")
        assert "unreachable" in status or "cannot connect" in status
        time.sleep(30)
        assert daemon_active(host) == "active"
        assert host.unit_props("unitvisor.service", "NRestarts")["NRestarts"] == "0"
    finally:
        postgres.start()
    for n, run_id in enumerate(runs):
        data = host.wait_run(run_id, timeout=90)
        assert data["attempts"][0]["exit_status"] == f"exit:{n}"
    wait_for(lambda: not host.loaded_run_units(), what="units to be released")
    assert "database" not in host.unit_props("unitvisor.service", "StatusText")["StatusText"]


def test_systemd_reload_and_reexec_lose_nothing(host: Host) -> None:
    host.start()
    runs = [host.submit("--", *host.gated("reexec", exit_code=2)) for _ in range(3)]
    for run_id in runs:
        wait_for(lambda r=run_id: running(host, r), what="runs to be running")
    host.tb.run("systemctl", "daemon-reload")
    host.tb.run("systemctl", "daemon-reexec")
    host.open_gate("reexec")
    for run_id in runs:
        data = host.wait_run(run_id, timeout=60)
        assert data["attempts"][0]["exit_status"] == "exit:2"
    after = host.submit("--", "/bin/true")
    assert host.wait_run(after)["state"] == "succeeded"
    assert daemon_active(host) == "active"

"""The first run end to end: submit -> daemon in a real systemd -> outcome on the attempt."""

from __future__ import annotations

import time

from supervisor import fleet, store
from tests.harness.host import DEFAULT_CONFIG, Host, wait_for


def test_failing_run_is_recorded_with_its_limits(host: Host) -> None:
    host.start()
    run_id = host.submit("--memory", "256M", "--cpu", "50%", "--tasks", "32", "--",
                         "/bin/sh", "-c", "echo hi; sleep 2; exit 3")
    unit = f"unitvisor-run-{run_id}-1.service"
    props = wait_for(lambda: (p := host.unit_props(unit, "LoadState", "MemoryMax", "CPUQuotaPerSecUSec", "TasksMax"))
                     .get("LoadState") == "loaded" and p, what=f"{unit} to be loaded")
    assert props["MemoryMax"] == "268435456"
    assert props["CPUQuotaPerSecUSec"] == "500ms"
    assert props["TasksMax"] == "32"

    data = host.wait_run(run_id)
    assert data["state"] == "failed"
    [attempt] = data["attempts"]
    assert attempt["outcome"] == "exit-code"
    assert attempt["exit_status"] == "exit:3"
    assert attempt["unit"] == unit
    assert attempt["invocation_id"]
    # Released once recorded: no failed unit is left behind in systemd.
    wait_for(lambda: unit not in host.loaded_run_units(), what=f"{unit} to be released")


def test_succeeding_run_is_recorded(host: Host) -> None:
    host.start()
    run_id = host.submit("--", "/bin/true")
    data = host.wait_run(run_id)
    assert data["state"] == "succeeded"
    [attempt] = data["attempts"]
    assert (attempt["outcome"], attempt["exit_status"]) == ("success", "exit:0")
    wait_for(lambda: not host.loaded_run_units(), what="the unit to be released")


def test_one_connection_per_host_and_a_submit_wakes_it(host: Host) -> None:
    """The daemon holds one session (queries and LISTEN alike), and a submit wakes it: with a poll
    interval far beyond the test's waits, a NOTIFY is the only way a run submitted later can start. Since
    schema 048 on the host's own channel, as is a cancel of its running run."""
    host.configure(config=DEFAULT_CONFIG.format(host_id=host.host_id, runs_extra="").replace(
        'poll_interval = "2s"', 'poll_interval = "600s"').replace(
        'reconcile_interval = "30s"', 'reconcile_interval = "600s"'))
    host.start()
    first = host.submit("--", *host.gated("first"))
    wait_for(lambda: host.show(first)["state"] == "running", what="the first run to run")
    # The first run's claim was at start or woken; the look again for other hosts' shares that any
    # claim schedules comes RECLAIM_AFTER later. Once past it, only a NOTIFY makes this daemon claim.
    time.sleep(2 * fleet.RECLAIM_AFTER)
    second = host.submit("--", *host.gated("second"))
    host.wait_run(second, states=("running",))  # 60 s at most, 600 s before the next poll

    def daemon_sessions() -> int:
        with store.connect(host.dsn) as conn:
            return conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                                "AND application_name = 'unitvisor' AND pid <> pg_backend_pid()").fetchone()[0]
    # The CLI's sessions (same application_name) end as its commands exit; the daemon's one stays.
    wait_for(lambda: daemon_sessions() == 1, what="the daemon's sessions to be one")
    host.open_gate("first")
    assert host.wait_run(first)["state"] == "succeeded"
    time.sleep(2 * fleet.RECLAIM_AFTER)  # past the look again that the second run's claim scheduled
    host.cli("cancel", second)
    # 600 s before the next poll's probe and reconcile pass: the notification did it.
    assert host.wait_run(second, timeout=15)["state"] == "cancelled"

"""Hold and freeze on a test bed host (schema 030): a held run is never claimed by a real daemon until
released; and this host, cgroup v1 (the test beds' layout), cannot freeze: its daemon says so, through
the database, instead of pretending. Freezing for real: tests/vm/test_freeze.py."""

from __future__ import annotations

import time

from tests.harness.host import Host, wait_for


def test_a_held_run_waits_until_released(host: Host) -> None:
    host.start()
    run_id = host.submit("--hold", "--", "/bin/true")
    time.sleep(5)  # two poll intervals of the test config (2 s), and the submit's notification: none claims it
    data = host.show(run_id)
    assert (data["state"], data["attempts"]) == ("queued", [])
    assert data["wait_reason"].startswith("held since ")
    host.cli("release", run_id)
    assert host.wait_run(run_id, timeout=30)["state"] == "succeeded"


def test_freeze_on_a_cgroup_v1_host_is_refused_and_said(host: Host) -> None:
    host.start()
    run_id = host.submit("--", "/bin/sleep", "300")
    wait_for(lambda: host.show(run_id)["state"] == "running", timeout=30, what="the run to be running")
    result = host.cli("freeze", run_id, "--timeout", "20s", check=False)
    assert result.returncode == 1, result.stdout
    assert f"run {run_id}: freeze refused by its host at " in result.stderr
    assert "systemd refused to freeze" in result.stderr
    [attempt] = host.show(run_id)["attempts"]
    assert attempt["freeze"]["refused"] and attempt["freeze"]["state"] == "thawed"
    assert "freeze-refused" in host.daemon_log()
    host.cli("cancel", run_id)
    assert host.wait_run(run_id, timeout=30)["state"] == "cancelled"

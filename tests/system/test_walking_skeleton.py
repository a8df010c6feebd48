"""The first run end to end: submit -> daemon in a real systemd -> outcome on the attempt."""

from __future__ import annotations

from tests.harness.host import Host, wait_for


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

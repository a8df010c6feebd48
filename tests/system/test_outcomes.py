"""Each outcome recorded correctly by a daemon under a real systemd (the claim-and-spawn issue)."""

from __future__ import annotations

import json

import pytest

from tests.harness.host import Host, wait_for


def only_attempt(data: dict) -> dict:
    [attempt] = data["attempts"]
    return attempt


@pytest.fixture
def started(host: Host) -> Host:
    host.configure(runs_extra='allowed_users = ["nobody", "no-such-user-here"]\nallowed_environment = ["GREETING"]')
    host.start()
    return host


def test_killed_by_sigkill_is_signal(started: Host) -> None:
    run_id = started.submit("--", "/bin/sleep", "300")
    unit = f"unitvisor-run-{run_id}-1.service"
    wait_for(lambda: started.show(run_id)["state"] == "running", what="the run to be running")
    started.tb.run("systemctl", "kill", "--signal=SIGKILL", unit)
    attempt = only_attempt(started.wait_run(run_id))
    assert (attempt["outcome"], attempt["exit_status"]) == ("signal", "signal:KILL")


def test_killed_by_sigterm_from_outside_is_signal_not_success(started: Host) -> None:
    run_id = started.submit("--", "/bin/sleep", "300")
    unit = f"unitvisor-run-{run_id}-1.service"
    wait_for(lambda: started.show(run_id)["state"] == "running", what="the run to be running")
    started.tb.run("systemctl", "kill", "--signal=SIGTERM", unit)
    data = started.wait_run(run_id)
    assert data["state"] == "failed"
    assert (only_attempt(data)["outcome"], only_attempt(data)["exit_status"]) == ("signal", "signal:TERM")


def test_runtime_limit_is_timeout(started: Host) -> None:
    run_id = started.submit("--runtime", "1s", "--", "/bin/sleep", "300")
    data = started.wait_run(run_id, timeout=30)
    assert data["state"] == "failed"
    assert only_attempt(data)["outcome"] == "timeout"


def test_missing_executable_is_start_failed_with_systemds_reason(started: Host) -> None:
    run_id = started.submit("--", "/usr/bin/no-such-program-here")
    data = started.wait_run(run_id)
    attempt = only_attempt(data)
    assert (attempt["outcome"], attempt["exit_status"]) == ("start-failed", "exit:203")
    assert "EXEC" in attempt["reason"] and "not proven" not in attempt["reason"]
    wait_for(lambda: not started.loaded_run_units(), what="the failed unit to be released")


def test_programs_own_exit_203_is_exit_code_not_start_failed(started: Host) -> None:
    # 203 is also systemd's EXEC failure code; this command ran and chose it. Several at once, so that
    # some exit before PID 1 sees their exec (ActiveEnterTimestamp stays 0) and the journal decides.
    run_ids = [started.submit("--", "/bin/sh", "-c", "exit 203") for _ in range(6)]
    for run_id in run_ids:
        attempt = only_attempt(started.wait_run(run_id))
        assert (attempt["outcome"], attempt["exit_status"]) == ("exit-code", "exit:203"), attempt
        assert attempt["reason"] == "exited with status 203"


def test_programs_own_exit_217_is_exit_code(started: Host) -> None:
    attempt = only_attempt(started.wait_run(started.submit("--", "/bin/sh", "-c", "exit 217")))
    assert (attempt["outcome"], attempt["exit_status"]) == ("exit-code", "exit:217")


def test_missing_working_directory_is_start_failed(started: Host) -> None:
    run_id = started.submit("--workdir", "/no/such/dir", "--", "/bin/true")
    attempt = only_attempt(started.wait_run(run_id))
    assert (attempt["outcome"], attempt["exit_status"]) == ("start-failed", "exit:200")
    assert "CHDIR" in attempt["reason"] and "not proven" not in attempt["reason"]


def test_unknown_run_user_is_start_failed(started: Host) -> None:
    run_id = started.submit("--user", "no-such-user-here", "--", "/bin/true")
    attempt = only_attempt(started.wait_run(run_id))
    assert attempt["outcome"] == "start-failed"
    assert "USER" in attempt["reason"] and "not proven" not in attempt["reason"]


def waiting_reason(host: Host, run_id: str) -> str:
    """The reason a run that this host may not run waits, once the fleet upkeep recorded it."""
    # The event, not wait_reason: `show` (as the admin) says why at once, from fleet_refusal; the
    # event is what the fleet's upkeep records, once the run has waited two poll intervals.
    data = wait_for(lambda: (d := host.show(run_id)) and [e for e in d["events"]
                                                          if (e["reason"] or "").startswith("waiting: ")] and d,
                    timeout=30, what=f"run {run_id} to say why it waits")
    assert data["state"] == "queued" and data["attempts"] == []
    return data["wait_reason"]


def test_user_not_allowed_is_never_claimed_and_says_why_it_waits(started: Host) -> None:
    run_id = started.submit("--user", "root", "--", "/bin/true")
    assert waiting_reason(started, run_id) == "no live host accepts it: user root is not allowed (testhost-1)"


def test_executable_outside_allowlist_is_never_claimed_and_starts_no_unit(started: Host) -> None:
    run_id = started.submit("--", "/usr/sbin/nologin")
    reason = waiting_reason(started, run_id)
    assert reason == "no live host accepts it: executable /usr/sbin/nologin is not allowed (testhost-1)"
    assert started.loaded_run_units() == []
    # A run this host may run still runs beside it: the waiting one blocks nothing.
    assert started.wait_run(started.submit("--", "/bin/true"))["state"] == "succeeded"
    assert started.show(run_id)["state"] == "queued"


def test_cancel_while_running_is_cancelled(started: Host) -> None:
    run_id = started.submit("--", "/bin/sleep", "300")
    wait_for(lambda: started.show(run_id)["state"] == "running", what="the run to be running")
    out = started.cli("cancel", run_id).stdout
    assert "cancel requested" in out
    data = started.wait_run(run_id, timeout=30)
    assert data["state"] == "cancelled"
    assert only_attempt(data)["outcome"] == "cancelled"
    wait_for(lambda: not started.loaded_run_units(), what="the cancelled unit to be gone")


def test_cancel_ignores_sigterm_then_sigkill_after_grace(started: Host) -> None:
    run_id = started.submit("--", "/bin/sh", "-c", "trap '' TERM; while :; do sleep 1; done")
    wait_for(lambda: started.show(run_id)["state"] == "running", what="the run to be running")
    started.cli("cancel", run_id)
    data = started.wait_run(run_id, timeout=30)  # stop_grace is 3s in the test config
    assert only_attempt(data)["outcome"] == "cancelled"


def test_cancel_queued_run_never_starts(host: Host) -> None:
    run_id = host.submit("--", "/bin/true")  # no daemon running yet
    assert "cancelled" in host.cli("cancel", run_id).stdout
    host.start()
    # A run submitted after it has been claimed and run: the daemon had its chance at the first.
    assert host.wait_run(host.submit("--", "/bin/true"))["state"] == "succeeded"
    data = host.show(run_id)
    assert data["state"] == "cancelled"
    assert data["attempts"] == []
    finished = host.cli("cancel", run_id, check=False)
    assert finished.returncode == 1
    assert "already cancelled" in finished.stderr


def test_limits_and_sandbox_appear_in_systemctl_show(started: Host) -> None:
    run_id = started.submit("--memory", "128M", "--cpu", "150%", "--tasks", "16", "--io-weight", "50",
                            "--runtime", "2m", "--", "/bin/sleep", "300")
    unit = f"unitvisor-run-{run_id}-1.service"
    wait_for(lambda: started.show(run_id)["state"] == "running", what="the run to be running")
    props = started.unit_props(unit, "MemoryMax", "MemorySwapMax", "CPUQuotaPerSecUSec", "TasksMax", "IOWeight",
                               "RuntimeMaxUSec", "DynamicUser", "NoNewPrivileges", "PrivateTmp", "ProtectSystem",
                               "ProtectHome", "Slice", "Type", "RemainAfterExit")
    assert props == {
        "MemoryMax": "134217728", "MemorySwapMax": "0", "CPUQuotaPerSecUSec": "1.500000s", "TasksMax": "16",
        "IOWeight": "50", "RuntimeMaxUSec": "2min", "DynamicUser": "yes", "NoNewPrivileges": "yes", "PrivateTmp": "yes",
        "ProtectSystem": "strict", "ProtectHome": "yes", "Slice": "unitvisor.slice", "Type": "exec",
        # An ended unit is kept loaded by the daemon's reference (AddRef), not as active/exited.
        "RemainAfterExit": "no",
    }
    started.cli("cancel", run_id)
    started.wait_run(run_id)


def test_output_found_by_run_field_and_by_unit(started: Host) -> None:
    run_id = started.submit("--env", "GREETING=hello there", "--", "/bin/sh", "-c", 'echo "$GREETING from $0"')
    data = started.wait_run(run_id)
    unit = only_attempt(data)["unit"]

    def lines(*match: str) -> list[str]:
        out = started.tb.run("journalctl", *match, "--no-pager", "-o", "json", check=False).stdout
        return [json.loads(line)["MESSAGE"] for line in out.splitlines() if line.strip()]

    assert "hello there from /bin/sh" in wait_for(lambda: lines(f"UNITVISOR_RUN={run_id}"), what="journal")
    assert "hello there from /bin/sh" in lines("-u", unit)
    assert "hello there from /bin/sh" in lines(f"UNITVISOR_RUN={run_id}", "UNITVISOR_ATTEMPT=1")


def test_hostile_arguments_run_exactly_as_written(started: Host) -> None:
    hostile = ["$HOME", "${PATH}", "%n", "%%", "a b", "'; DROP TABLE unitvisor.runs; --", "back\\slash", "new\nline"]
    run_id = started.submit("--", "/usr/bin/printf", "[%s]\\n", *hostile)
    data = started.wait_run(run_id)
    assert data["state"] == "succeeded"
    assert data["argv"] == ["/usr/bin/printf", "[%s]\\n", *hostile]
    out = started.tb.run("journalctl", f"UNITVISOR_RUN={run_id}", "--no-pager", "-o", "cat").stdout
    expected = "".join(f"[{arg}]\n" for arg in hostile)
    assert out == expected


def test_run_ending_while_daemon_is_stopped_is_recorded_after_restart(started: Host) -> None:
    run_id = started.submit("--", *started.gated("down", exit_code=7))
    wait_for(lambda: started.show(run_id)["state"] == "running", what="the run to be running")
    started.stop()
    started.open_gate("down")
    unit = f"unitvisor-run-{run_id}-1.service"
    wait_for(lambda: started.unit_props(unit, "ActiveState")["ActiveState"] == "failed", what="the run to end")
    assert started.show(run_id)["state"] == "running"  # nobody recorded it yet
    started.start()
    data = started.wait_run(run_id)
    assert (only_attempt(data)["outcome"], only_attempt(data)["exit_status"]) == ("exit-code", "exit:7")
    wait_for(lambda: not started.loaded_run_units(), what="the unit to be released")


def test_daemon_stop_leaves_runs_running(started: Host) -> None:
    run_id = started.submit("--", "/bin/sleep", "300")
    unit = f"unitvisor-run-{run_id}-1.service"
    wait_for(lambda: started.show(run_id)["state"] == "running", what="the run to be running")
    started.stop()
    # The daemon exited by itself on SIGTERM (not killed after TimeoutStopSec), and the run is untouched.
    assert started.unit_props("unitvisor.service", "Result")["Result"] == "success"
    assert "stopping host=" in started.daemon_log()
    assert started.unit_props(unit, "ActiveState", "SubState") == {"ActiveState": "active", "SubState": "running"}
    started.start()
    assert started.show(run_id)["state"] == "running"
    assert len(started.show(run_id)["attempts"]) == 1
    started.cli("cancel", run_id)
    started.wait_run(run_id)


def test_two_hundred_runs_at_once_all_recorded_none_left_loaded(started: Host) -> None:
    script = "for i in $(seq 200); do {bin} --dsn '{dsn}' submit -- /bin/true >/dev/null || exit 1; done"
    from tests.harness.host import VENV_BIN

    started.stop()  # submit them all before the daemon wakes, so that they are claimed in batches
    started.tb.run("/bin/sh", "-c", script.format(bin=VENV_BIN / "unitvisor", dsn=started.dsn), timeout=300)
    started.start()
    rows = wait_for(lambda: (r := json.loads(started.cli("runs", "--limit", "1000", "--json").stdout))
                    and all(x["state"] == "succeeded" for x in r) and r, timeout=180, what="200 runs to succeed")
    assert len(rows) == 200
    assert all(x["outcome"] == "success" for x in rows)
    wait_for(lambda: not started.loaded_run_units(), timeout=60, what="every unit to be released")

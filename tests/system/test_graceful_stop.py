"""Graceful stop (schema 026) under a real systemd, on the test bed's one host: a warning before the runtime
limit that a run traps to checkpoint, and a cancel by a stop signal the run ignores, ended by SIGKILL once
its stop_timeout has passed. Each run lasts seconds."""

from __future__ import annotations

from datetime import datetime

import pytest

from tests.harness.host import Host, wait_for

# Traps the warning: writes its checkpoint to a file (the unit's private /tmp), then prints the file back,
# so that the attempt's output tail shows that the file was written, and when. Not TERM: the runtime limit
# ends it with systemd's default stop signal.
CHECKPOINTING = ("i=0; trap 'echo \"step=$i\" > /tmp/checkpoint; echo \"checkpoint: $(cat /tmp/checkpoint)\"' USR1; "
                 "while :; do i=$((i+1)); sleep 0.2; done")
# Ignores INT, and so does every `sleep` it starts (an ignored signal stays ignored across exec).
IGNORES_INT = "trap '' INT; while :; do sleep 0.2; done"


@pytest.fixture
def started(host: Host) -> Host:
    host.start()
    return host


def only_attempt(data: dict) -> dict:
    [attempt] = data["attempts"]
    return attempt


def at(text: str) -> datetime:
    return datetime.fromisoformat(text)


def test_a_run_traps_its_warning_and_checkpoints_before_the_runtime_limit_ends_it(started: Host) -> None:
    """Failed before the daemon sent warnings: no checkpoint in the output, no warned_at."""
    run_id = started.submit("--runtime", "6s", "--warn-before", "3s", "--", "/bin/sh", "-c", CHECKPOINTING)
    data = started.wait_run(run_id, timeout=60)
    attempt = only_attempt(data)
    assert data["state"] == "failed"
    assert (attempt["outcome"], attempt["exit_status"]) == ("timeout", "signal:TERM"), attempt
    assert attempt["reason"] == "runtime limit reached: ended by SIGTERM"
    assert data["stop"] == {"stop_signal": "TERM", "stop_timeout": None, "warn_before": 3, "warn_signal": "USR1"}
    # Sent once, about 3 s before the end (the daemon's loop and the machine's load give it a margin).
    assert attempt["warned_at"] is not None
    before_end = (at(attempt["ended_at"]) - at(attempt["warned_at"])).total_seconds()
    assert 1.0 < before_end < 4.5, (attempt["warned_at"], attempt["ended_at"])
    warned = [e for e in data["events"] if e["reason"].startswith("sent SIGUSR1")]
    assert len(warned) == 1, data["events"]
    wait_for(lambda: only_attempt(started.show(run_id))["output_tail"], what="the output tail")
    tail = only_attempt(started.show(run_id))["output_tail"]
    assert tail.count("checkpoint: step=") == 1, tail


def test_a_cancel_by_int_that_the_run_ignores_ends_by_sigkill_after_its_stop_timeout(started: Host) -> None:
    run_id = started.submit("--stop-signal", "INT", "--stop-timeout", "1s", "--", "/bin/sh", "-c", IGNORES_INT)
    unit = f"unitvisor-run-{run_id}-1.service"
    wait_for(lambda: started.show(run_id)["state"] == "running", what="the run to be running")
    shown = started.tb.run("systemctl", "show", unit, "-p", "KillSignal", "-p", "TimeoutStopUSec").stdout
    assert "KillSignal=2" in shown and "TimeoutStopUSec=1s" in shown, shown
    started.cli("cancel", run_id)
    data = started.wait_run(run_id, timeout=30)
    attempt = only_attempt(data)
    assert data["state"] == "cancelled"
    assert (attempt["outcome"], attempt["exit_status"]) == ("cancelled", "signal:KILL"), attempt
    assert attempt["reason"] == ("cancelled by request: SIGINT did not end it within its stop timeout: "
                                 "killed by SIGKILL")
    # The stop began when the daemon acted on the cancel; SIGKILL came stop_timeout (1 s) later.
    stopping = [e for e in data["events"] if e["reason"].startswith("stopping unit")]
    assert stopping and "SIGINT, then SIGKILL after 1 s" in stopping[0]["reason"], data["events"]
    took = (at(attempt["ended_at"]) - at(stopping[0]["at"])).total_seconds()
    assert 0.8 < took < 3.5, took

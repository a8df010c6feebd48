"""Issue 21, suspected and proven: a journal that cannot be read, or no longer holds what PID 1 logged,
made the reconciler start an attempt a second time. Really done in the test bed: the daemon killed at
`after-start` (StartTransientUnit done, the start not recorded), the run's unit ends cleanly and PID 1
collects it (no daemon holds it), then the journal is vacuumed, or made too slow to answer, before the
daemon comes back. On 0.5.1 the attempt's unit was started again in both cases."""

from __future__ import annotations

import time

from tests.harness.host import Host, daemon_active, journal_invocations, wait_for

JOURNALCTL = "/usr/bin/journalctl"
REAL = "/usr/bin/journalctl.real"


def _killed_after_start_with_a_collected_unit(host: Host, *submit: str) -> tuple[str, str]:
    """A run started by a daemon that died before recording the start; its unit ran /bin/true and is gone."""
    host.install_units({"UNITVISOR_FAULT": "after-start"})
    host.tb.run("systemctl", "start", "--no-block", "unitvisor.service")
    run_id = host.submit(*submit, "--", "/bin/true")
    unit = f"unitvisor-run-{run_id}-1.service"
    wait_for(lambda: daemon_active(host) in ("failed", "inactive"), timeout=30, what="the daemon to die at after-start")
    host.tb.run("systemctl", "reset-failed", "unitvisor.service", check=False)
    wait_for(lambda: unit not in host.loaded_run_units() and len(journal_invocations(host, unit)) == 1,
             what="the unit to have run once and been collected")
    data = host.show(run_id)
    assert (data["state"], data["attempts"][0]["started_at"]) == ("starting", None)  # the start is not recorded
    return run_id, unit


def test_a_vacuumed_journal_never_starts_the_attempt_again(host: Host) -> None:
    run_id, unit = _killed_after_start_with_a_collected_unit(host, "--max-attempts", "2")
    host.tb.run("journalctl", "--rotate")
    time.sleep(2)  # every record up to the rotation is older than the 1 s the vacuum keeps
    host.tb.run("journalctl", "--vacuum-time=1s")
    assert journal_invocations(host, unit) == set(), "the vacuum left PID 1's records of the unit"
    host.start()
    data = wait_for(lambda: (d := host.show(run_id)) and len(d["attempts"]) == 2 and d["state"] == "succeeded"
                    and d, timeout=90, what="the run's second attempt to succeed")
    first, second = data["attempts"]
    assert first["outcome"] == "lost" and "not started again" in first["reason"], first
    assert journal_invocations(host, unit) == set(), "the first attempt's unit was started a second time"
    assert second["outcome"] == "success"
    assert len(journal_invocations(host, f"unitvisor-run-{run_id}-2.service")) == 1


def _slow_journalctl(host: Host) -> None:
    """journalctl answers only after 30 s, past the daemon's 10 s timeout (a journal on a hung disk)."""
    host.tb.run("mv", JOURNALCTL, REAL)
    host.tb.write(JOURNALCTL, f'#!/bin/sh\nsleep 30\nexec {REAL} "$@"\n')
    host.tb.run("chmod", "0755", JOURNALCTL)


def _restore_journalctl(host: Host) -> None:
    if host.tb.run("test", "-e", REAL, check=False).returncode == 0:
        host.tb.run("mv", "-f", REAL, JOURNALCTL)


def test_a_journal_too_slow_to_read_never_starts_the_attempt_again(host: Host) -> None:
    run_id, unit = _killed_after_start_with_a_collected_unit(host)
    _slow_journalctl(host)
    try:
        host.start()  # ready after its first pass, which asked the journal about the unit and timed out
        data = host.show(run_id)
        assert data["state"] == "starting" and data["attempts"][0]["outcome"] is None, data  # waits, settles nothing
        assert host.loaded_run_units() == [], "the attempt's unit was started a second time"
        log = host.tb.run(REAL, "-u", "unitvisor.service", "--no-pager", "-o", "cat", check=False).stdout
        assert "journal-unreadable" in log
    finally:
        _restore_journalctl(host)
    assert len(journal_invocations(host, unit)) == 1
    # Readable again: the next pass (here, the one after a restart) settles it from the journal.
    host.tb.run("systemctl", "restart", "unitvisor.service", timeout=120)
    data = host.wait_run(run_id, timeout=90)
    assert data["state"] == "succeeded" and len(data["attempts"]) == 1, data
    assert "journal" in data["attempts"][0]["reason"]
    assert len(journal_invocations(host, unit)) == 1, "the attempt's unit was started a second time"

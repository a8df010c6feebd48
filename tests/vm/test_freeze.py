"""Freeze and thaw on a real cgroup-v2 host (schema 030): the operator's request goes through the
database to the daemon, which freezes the run's unit with systemd's FreezeUnit; the run's processes
stop where they are (a counter that does not advance) and go on after ThawUnit. The system tier's
cgroup-v1 containers cannot freeze (tests/system/test_hold_freeze.py)."""

from __future__ import annotations

import time

from tests.vm.conftest import VmHost

PY = "/usr/bin/python3"
# Prints an ever-growing count, twice a second, to its output (the journal: a run's /tmp and /var/tmp
# are its own, PrivateTmp=yes).
COUNTER = ("import time\n"
           "i = 0\n"
           "while True:\n"
           "    i += 1\n"
           "    print(i, flush=True)\n"
           "    time.sleep(0.5)")


def count(vm_host: VmHost, run_id: str, printed: bool = False) -> int:
    """The last count the run printed (0: none yet). With `printed` (it has printed already), a read that
    finds no count is a failed read, not a count of 0: read again, and fail with what the guest said if
    it stays so (CI once read 0 right after 33, with the run frozen)."""
    for _ in range(5):
        # The run's own output only (_TRANSPORT=stdout), not systemd's lines about its unit.
        result = vm_host.run("journalctl", f"UNITVISOR_RUN={run_id}", "_TRANSPORT=stdout", "-o", "cat", "-q",
                             check=False)
        counts = [int(line) for line in result.stdout.split() if line.isdigit()]
        if counts or not printed:
            return counts[-1] if counts else 0
        time.sleep(1)
    raise AssertionError(f"the run's output, printed before, read as nothing five times: {result!r}")


def wait_count_above(vm_host: VmHost, run_id: str, value: int, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while (now := count(vm_host, run_id)) <= value:
        assert time.monotonic() < deadline, f"the counter stayed at {now}"
        time.sleep(1)
    return now


def test_a_frozen_run_stops_where_it_is_and_goes_on_when_thawed(vm_host: VmHost) -> None:
    run_id = vm_host.submit("--", PY, "-c", COUNTER)
    wait_count_above(vm_host, run_id, 0)
    [attempt] = vm_host.show(run_id)["attempts"]

    assert vm_host.operator("freeze", run_id, "--timeout", "60s").stdout.strip() == f"run {run_id} frozen"
    assert vm_host.prop(attempt["unit"], "FreezerState") == "frozen"
    time.sleep(2)  # a line printed just before the freeze may still be on its way to the journal
    stopped = count(vm_host, run_id, printed=True)
    time.sleep(5)
    assert count(vm_host, run_id, printed=True) == stopped
    shown = vm_host.show(run_id)
    assert shown["state"] == "running" and shown["attempts"][0]["freeze"]["state"] == "frozen"

    assert vm_host.operator("thaw", run_id, "--timeout", "60s").stdout.strip() == f"run {run_id} thawed"
    wait_count_above(vm_host, run_id, stopped)
    vm_host.operator("cancel", run_id)
    assert vm_host.wait_ended(run_id)["state"] == "cancelled"

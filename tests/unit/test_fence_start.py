"""The lease checked at a run's start (issue 21, the model's START_NEEDS_LEASE): fence.may_start, its
/bin/sh twin that every run's unit runs as ExecCondition= with fencing on (fence.start_check_script,
run here by the real /bin/sh against lease, boot id and uptime files of the test's own), the unit's
property (unitspec.start_condition), and what a refused start is recorded as (reconciler.decide).

Each of these failed before the check existed: no such functions, no ExecConditionEx in the unit, and
Result=exec-condition settled as the run's own `start-failed`."""

from __future__ import annotations

import dataclasses
import subprocess
import uuid
from pathlib import Path

import pytest

from supervisor import fence, journal, unitspec
from supervisor.config import FleetSettings, RunSettings, Settings
from supervisor.fence import Lease
from supervisor.model import Attempt, Run
from supervisor.reconciler import Action, decide
from supervisor.systemd import UnitState

BOOT = "5f1c0e0a-8d3b-4b8e-9a43-0c1d2e3f4a5b"
OTHER_BOOT = "0b7a1d2c-1111-4c4c-9d9d-abcdefabcdef"


def sh_says(tmp_path: Path, lease_text: bytes | None, uptime: str) -> bool:
    """Whether the start check, run by /bin/sh, lets a unit start (exit 0; 1 refuses; anything else is
    a failed check, which systemd would count as the unit's failure: never wanted)."""
    lease = tmp_path / "lease"
    if lease_text is None:
        lease.unlink(missing_ok=True)
    else:
        lease.write_bytes(lease_text)
    (tmp_path / "uptime").write_text(f"{uptime} 1234.56\n")
    script = fence.start_check_script(lease, tmp_path / "uptime")
    done = subprocess.run(["/bin/sh", "-c", script], capture_output=True, timeout=10)
    assert done.returncode in (0, 1), (done.returncode, done.stderr)
    assert not done.stderr, done.stderr
    return done.returncode == 0


NOW = 5000.25  # /proc/uptime: two decimals

# (lease, may it start at NOW?) for every kind of lease; the deadlines stay 10 ms or more from NOW (the
# shell compares hundredths of a second, see start_check_script).
LEASES = [
    (Lease(NOW + 6.0, True, BOOT), True),
    (Lease(NOW + 0.011, True, BOOT), True),
    (Lease(NOW - 0.011, True, BOOT), False),
    (Lease(NOW - 300.0, True, BOOT), False),
    (Lease(NOW, True, BOOT), False),  # the deadline itself: expired
    (Lease(NOW - 300.0, False, BOOT), True),  # fencing off: never expires
    (Lease(NOW + 6.0, True, OTHER_BOOT), True),  # the boot id is not compared (may_start says why)
    (Lease(NOW - 1.0, True, OTHER_BOOT), False),
    (Lease(NOW + 6.0, True, BOOT, source="fence"), True),  # the fence's provisional lease counts
    (Lease(NOW - 1.0, True, BOOT, source="fence"), False),
    (Lease(float(int(NOW) + 7), True, BOOT), True),  # an integral deadline
    (Lease(0.5, True, BOOT), False),
    (Lease(123456789.123456, True, BOOT), True),
]


@pytest.mark.parametrize(("lease", "allowed"), LEASES)
def test_may_start_is_a_valid_lease_of_this_boot(lease: Lease, allowed: bool) -> None:
    assert fence.may_start(lease, NOW) is allowed


def test_no_lease_or_an_unreadable_one_refuses_a_start() -> None:
    assert not fence.may_start(None, NOW)


@pytest.mark.parametrize(("lease", "allowed"), LEASES)
def test_the_shell_check_agrees_with_may_start(tmp_path: Path, lease: Lease, allowed: bool) -> None:
    assert sh_says(tmp_path, lease.encode(), f"{NOW:.2f}") is allowed


NOT_LEASES = [
    None,  # no lease at all
    b"",
    b"not a lease\n",
    b'{"deadline": "soon", "fencing": true, "boot_id": "' + BOOT.encode() + b'", "source": "daemon"}\n',
    b'{"deadline": 9999.0, "fencing": "yes", "boot_id": "' + BOOT.encode() + b'", "source": "daemon"}\n',
    b'{"fencing": true, "boot_id": "' + BOOT.encode() + b'"}\n',
]


@pytest.mark.parametrize("text", NOT_LEASES)
def test_what_is_not_a_lease_refuses_a_start_in_both(tmp_path: Path, text: bytes | None) -> None:
    assert not fence.may_start(fence.parse_lease(text) if text is not None else None, NOW)
    assert not sh_says(tmp_path, text, f"{NOW:.2f}")


@pytest.mark.parametrize("deadline", [b"1e30", b"99999999999999999999999.5", b"-1.5", b"1.5e3"])
def test_a_deadline_the_shell_cannot_compare_refuses(tmp_path: Path, deadline: bytes) -> None:
    """Where the two differ: a deadline nobody writes (json.dumps of CLOCK_BOOTTIME seconds is digits
    and one dot). Python would read some of these as far away; the shell refuses: the safe side."""
    text = b'{"deadline": ' + deadline + b', "fencing": true, "boot_id": "' + BOOT.encode() + b'"}\n'
    assert not sh_says(tmp_path, text, f"{NOW:.2f}")


def test_the_shell_check_reads_the_lease_the_daemon_writes(tmp_path: Path) -> None:
    """Through write_lease (the rename the daemon does), with the uptime moving past the deadline."""
    fence.write_lease(Lease(100.07, True, BOOT), tmp_path / "lease")
    text = (tmp_path / "lease").read_bytes()
    assert sh_says(tmp_path, text, "100.06")
    assert not sh_says(tmp_path, text, "100.07")
    assert not sh_says(tmp_path, text, "100.08")


def test_the_check_ignores_what_the_runs_environment_may_set(tmp_path: Path) -> None:
    """PID 1 runs the check with the run's environment file: a field separator of the submitter's must
    not change how the lease or the uptime is read."""
    lease = tmp_path / "lease"
    lease.write_bytes(Lease(NOW - 1, True, BOOT).encode())
    (tmp_path / "uptime").write_text(f"{NOW:.2f} 1.00\n")
    script = fence.start_check_script(lease, tmp_path / "uptime")
    for env in ({"IFS": "."}, {"IFS": "0123456789"}, {"PATH": str(tmp_path)}):
        done = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, timeout=10)
        assert done.returncode == 1, (env, done)


# -- the unit's property --------------------------------------------------------------------------------


RUN_ID = uuid.UUID("12345678-9abc-4def-8123-456789abcdef")


def build(cut_off: bool) -> dict:
    cfg = dataclasses.replace(Settings(), runs=RunSettings(allowed_executables=("/bin/true",)),
                              fleet=FleetSettings(stop_runs_when_cut_off=cut_off))
    run = Run(id=RUN_ID, argv=["/bin/true"])
    return unitspec.build(run, Attempt(run_id=RUN_ID, attempt=1, host_id="h1", unit_name=unitspec.unit_name(RUN_ID, 1)),
                          cfg)


def test_with_fencing_on_a_runs_unit_checks_the_lease_at_its_start_outside_its_sandbox() -> None:
    [(path, argv, flags)] = build(cut_off=True)[b"ExecConditionEx"]
    assert (path, argv[:2]) == (b"/bin/sh", [b"/bin/sh", b"-c"])
    assert argv[2] == fence.start_check_script().encode()
    assert str(fence.LEASE).encode() in argv[2]  # (the tests' own /run/unitvisor, see tests/conftest.py)
    # `+`: as root, without the run's user or namespaces (a run that may become root cannot reach
    # /run/unitvisor, root_confinement; the check must).
    assert b"privileged" in flags
    # `:`: the shell's ${...}, not systemd's (which replaced them with unset variables: every start refused).
    assert b"no-env-expand" in flags


def test_with_fencing_off_no_check_and_no_process_more() -> None:
    assert b"ExecConditionEx" not in build(cut_off=False)


# -- what a refused start is recorded as -------------------------------------------------------------------


def refused_unit(result: str = "exec-condition") -> UnitState:
    # As systemd 252 shows a unit whose ExecCondition= exited 1 (tests/system/test_fence.py): inactive,
    # no main process ever, an invocation id.
    return UnitState(name=unitspec.unit_name(RUN_ID, 1), active_state="inactive", sub_state="dead", result=result,
                     exec_main_code=0, exec_main_status=0, invocation_id="0123456789abcdef0123456789abcdef",
                     job_pending=False)


def attempt() -> Attempt:
    return Attempt(run_id=RUN_ID, attempt=1, host_id="h1", unit_name=unitspec.unit_name(RUN_ID, 1))


def test_a_start_the_lease_check_refused_is_lost_not_the_runs_failure() -> None:
    decision = decide(Run(id=RUN_ID, argv=["/bin/true"]), attempt(), refused_unit())
    assert decision.action is Action.SETTLE
    assert decision.outcome is not None
    assert (decision.outcome.outcome, decision.outcome.exit_status) == ("lost", None)
    assert "lease had expired" in decision.outcome.reason and "never ran" in decision.outcome.reason


def test_a_cancel_requested_meanwhile_wins_over_a_refused_start() -> None:
    from datetime import UTC, datetime
    run = Run(id=RUN_ID, argv=["/bin/true"], cancel_requested_at=datetime(2024, 5, 1, tzinfo=UTC))
    decision = decide(run, attempt(), refused_unit())
    assert decision.outcome is not None and decision.outcome.outcome == "cancelled"


def test_another_start_failure_is_still_start_failed() -> None:
    decision = decide(Run(id=RUN_ID, argv=["/bin/true"]), attempt(), refused_unit("resources"))
    assert decision.outcome is not None and decision.outcome.outcome == "start-failed"


# -- what the journal says of a refused start once the unit is gone ---------------------------------


def skipped_records() -> list[dict[str, str]]:
    """PID 1's records of a unit whose lease check refused its start (systemd 252, test bed)."""
    base = {"UNIT": unitspec.unit_name(RUN_ID, 1), "INVOCATION_ID": "i1", "_PID": "1"}
    return [{**base, "MESSAGE_ID": "7d4958e842da4a758f6c1cdc7b36dcc5", "JOB_TYPE": "start"},
            {**base, "MESSAGE_ID": journal.MSG_UNIT_SKIPPED, "UNIT_RESULT": "exec-condition",
             "__REALTIME_TIMESTAMP": "1796175618127406"},
            {**base, "MESSAGE_ID": journal.MSG_UNIT_STARTED, "JOB_TYPE": "start", "JOB_RESULT": "done",
             "MESSAGE": "Condition check resulted in ... being skipped."}]


def test_the_journal_of_a_refused_start_proves_the_command_never_ran() -> None:
    assert journal.program_ran(skipped_records(), trust_absence=False) is False
    found = journal.found_from_records(skipped_records())
    assert found is not None
    assert (found.outcome.outcome, found.outcome.exit_status) == ("lost", None)
    assert "lease had expired" in found.outcome.reason and "the unit was gone" in found.outcome.reason

"""supervisor.reconciler: every row of the decision table in the module docstring, plus UnitState.has_ended."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest

from supervisor import store
from supervisor.model import Attempt, Run
from supervisor.outcomes import CLD_DUMPED, CLD_EXITED, CLD_KILLED, Outcome
from supervisor.reconciler import Action, Decision, change_needs_rows, decide, decide_on_change, decide_orphan
from supervisor.systemd import UnitState
from supervisor.unitspec import unit_name

RUN_ID = uuid.UUID("12345678-9abc-4def-8123-456789abcdef")
NAME = unit_name(RUN_ID, 1)
T0 = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
INV = "0123456789abcdef0123456789abcdef"


def make_run(cancelled=False):
    return Run(id=RUN_ID, argv=["/bin/true"], cancel_requested_at=T0 if cancelled else None)


def make_attempt(started=False, invocation_id=None):
    return Attempt(run_id=RUN_ID, attempt=1, host_id="h1", unit_name=NAME, claimed_at=T0,
                   started_at=T0 if started else None, invocation_id=invocation_id)


def unit(active="active", sub="running", result="success", code=0, status=0, invocation_id=INV, job=False,
         active_enter_usec=0):
    return UnitState(name=NAME, active_state=active, sub_state=sub, result=result, exec_main_code=code,
                     exec_main_status=status, invocation_id=invocation_id, job_pending=job,
                     active_enter_usec=active_enter_usec)


RUNNING = dict(active="active", sub="running")
EXITED_OK = dict(active="active", sub="exited", result="success", code=CLD_EXITED, status=0)
FAILED_3 = dict(active="failed", sub="failed", result="exit-code", code=CLD_EXITED, status=3)


# -- UnitState.has_ended ----------------------------------------------------------------------------

@pytest.mark.parametrize(("active", "sub", "job", "ended"), [
    ("failed", "failed", False, True),
    ("active", "exited", False, True),
    ("inactive", "dead", False, True),
    ("active", "running", False, False),
    ("activating", "start", False, False),
    ("deactivating", "stop-sigterm", False, False),
    ("reloading", "reload", False, False),
    ("active", "start", False, False),
    ("failed", "failed", True, False),
    ("active", "exited", True, False),
    ("inactive", "dead", True, False),
    ("active", "running", True, False),
])
def test_has_ended(active, sub, job, ended):
    assert unit(active=active, sub=sub, job=job).has_ended is ended


# -- no unit ----------------------------------------------------------------------------------------

def test_not_started_not_cancelled_no_unit_starts():
    assert decide(make_run(), make_attempt(), None) == Decision(Action.START, NAME, "claimed but no unit yet")


def test_not_started_cancel_requested_no_unit_settles_cancelled():
    d = decide(make_run(cancelled=True), make_attempt(), None)
    assert d == Decision(Action.SETTLE, NAME, "cancelled before its unit started",
                         Outcome("cancelled", None, "cancelled before its unit started"))
    assert d.invocation_id is None


def test_started_no_unit_is_gone_lost():
    d = decide(make_run(), make_attempt(started=True, invocation_id=INV), None)
    assert d == Decision(Action.GONE, NAME, "unit is gone and left no outcome in systemd",
                         Outcome("lost", None,
                                 "the unit disappeared (host reboot, reset, or ended while no daemon held it) "
                                 "before its outcome was read, and the journal does not prove one"))


def test_started_no_unit_cancel_requested_is_gone_cancelled():
    d = decide(make_run(cancelled=True), make_attempt(started=True), None)
    assert d == Decision(Action.GONE, NAME, "unit gone after a cancel request",
                         Outcome("cancelled", None, "cancelled; the unit is gone"))


# -- unit still running -----------------------------------------------------------------------------

def test_running_unit_not_started_is_adopted():
    u = unit(**RUNNING)
    d = decide(make_run(), make_attempt(), u)
    assert d == Decision(Action.ADOPT, NAME, "unit is running; adopted", invocation_id=INV, unit=u)
    assert d.outcome is None


def test_running_unit_not_started_without_invocation_id_is_adopted():
    u = unit(**RUNNING, invocation_id="")
    d = decide(make_run(), make_attempt(), u)
    assert d == Decision(Action.ADOPT, NAME, "unit is running; adopted", invocation_id=None, unit=u)


def test_running_unit_started_but_invocation_unrecorded_is_adopted():
    u = unit(**RUNNING)
    d = decide(make_run(), make_attempt(started=True, invocation_id=None), u)
    assert d == Decision(Action.ADOPT, NAME, "unit is running; adopted", invocation_id=INV, unit=u)


def test_running_unit_fully_recorded_needs_nothing():
    d = decide(make_run(), make_attempt(started=True, invocation_id=INV), unit(**RUNNING))
    assert d == Decision(Action.NOTHING, NAME, "unit is running")


def test_running_unit_started_and_neither_side_has_invocation_id_needs_nothing():
    d = decide(make_run(), make_attempt(started=True), unit(**RUNNING, invocation_id=""))
    assert d == Decision(Action.NOTHING, NAME, "unit is running")


@pytest.mark.parametrize("attempt", [make_attempt(), make_attempt(started=True),
                                     make_attempt(started=True, invocation_id=INV)])
def test_running_unit_cancel_requested_is_stopped(attempt):
    u = unit(**RUNNING)
    d = decide(make_run(cancelled=True), attempt, u)
    assert d == Decision(Action.STOP, NAME, "cancel requested", invocation_id=INV, unit=u)
    assert d.outcome is None


def test_stop_without_invocation_id():
    u = unit(**RUNNING, invocation_id="")
    d = decide(make_run(cancelled=True), make_attempt(), u)
    assert d == Decision(Action.STOP, NAME, "cancel requested", invocation_id=None, unit=u)


@pytest.mark.parametrize("state", [dict(active="activating", sub="start"),
                                   dict(active="deactivating", sub="stop-sigterm"),
                                   dict(active="inactive", sub="dead", job=True),
                                   dict(active="failed", sub="failed", result="exit-code", code=CLD_EXITED, status=1,
                                        job=True),
                                   dict(active="active", sub="exited", code=CLD_EXITED, job=True)])
def test_unit_in_transition_is_treated_as_running(state):
    assert decide(make_run(), make_attempt(), unit(**state)).action is Action.ADOPT
    assert decide(make_run(), make_attempt(started=True, invocation_id=INV), unit(**state)).action is Action.NOTHING
    # A unit stopping by itself (no job: its runtime limit) is stopped all the same (below).
    assert decide(make_run(cancelled=True), make_attempt(started=True), unit(**state)).action is Action.STOP


def test_cancelled_unit_already_stopping_is_left_to_its_stop_job():
    d = decide(make_run(cancelled=True), make_attempt(started=True),
               unit(active="deactivating", sub="stop-sigterm", job=True))
    assert d == Decision(Action.NOTHING, NAME, "stopping after a cancel request")


def test_cancelled_unit_that_systemd_stops_on_its_own_is_stopped_with_a_job():
    """No job: systemd's own stop at RuntimeMaxSec=, which does not thaw a frozen unit (a frozen run
    past its runtime stays stopping, README, Hold and freeze). The cancel's StopUnit is a job, and a job
    thaws the unit first; the next pass sees the job and leaves it (above)."""
    u = unit(active="deactivating", sub="stop-sigterm")
    d = decide(make_run(cancelled=True), make_attempt(started=True, invocation_id=INV), u)
    assert d == Decision(Action.STOP, NAME, "cancel requested while systemd stops the unit on its own",
                         invocation_id=INV, unit=u)
    # Not cancelled, it is left to systemd's stop, as before.
    assert decide(make_run(), make_attempt(started=True, invocation_id=INV), u).action is Action.NOTHING


# -- unit ended -------------------------------------------------------------------------------------

@pytest.mark.parametrize("attempt", [make_attempt(), make_attempt(started=True),
                                     make_attempt(started=True, invocation_id=INV)])
def test_exited_cleanly_settles_success(attempt):
    u = unit(**EXITED_OK)
    d = decide(make_run(), attempt, u)
    assert d == Decision(Action.SETTLE, NAME, "unit ended: exited 0", Outcome("success", "exit:0", "exited 0"), INV, u)


def test_failed_unit_settles_with_its_outcome():
    u = unit(**FAILED_3)
    d = decide(make_run(), make_attempt(started=True), u)
    assert d == Decision(Action.SETTLE, NAME, "unit ended: exited with status 3",
                         Outcome("exit-code", "exit:3", "exited with status 3"), INV, u)


def test_inactive_unit_settles():
    d = decide(make_run(), make_attempt(started=True),
               unit(active="inactive", sub="dead", result="signal", code=CLD_KILLED, status=9))
    assert d.action is Action.SETTLE
    assert d.outcome == Outcome("signal", "signal:KILL", "killed by signal KILL")


@pytest.mark.parametrize(("state", "outcome"), [
    (dict(active="failed", sub="failed", result="timeout", code=CLD_KILLED, status=15), "start-failed"),
    (dict(active="failed", sub="failed", result="oom-kill", code=CLD_KILLED, status=9), "oom-kill"),
    (dict(active="failed", sub="failed", result="core-dump", code=CLD_DUMPED, status=11), "core-dump"),
    (dict(active="failed", sub="failed", result="exit-code", code=CLD_EXITED, status=203), "start-failed"),
    (dict(active="failed", sub="failed", result="start-limit-hit"), "start-failed"),
    (dict(active="failed", sub="failed", result="resources"), "start-failed"),
    (dict(active="active", sub="exited", result="success", code=CLD_KILLED, status=15), "signal"),
    (dict(active="inactive", sub="dead", result="success"), "lost"),
])
def test_ended_unit_settles_with_classified_outcome(state, outcome):
    d = decide(make_run(), make_attempt(started=True), unit(**state))
    assert d.action is Action.SETTLE
    assert d.outcome.outcome == outcome
    assert d.reason == f"unit ended: {d.outcome.reason}"


ACTIVE_AT = 1_700_000_000_000_000  # systemd's realtime clock, microseconds


@pytest.mark.parametrize(("runtime", "ran_sec", "code", "status", "outcome", "reason"), [
    # RuntimeMaxSec ended it: it ran its limit (a stop signal it handled, then exit 0, is still the limit's).
    (60, 60.2, CLD_KILLED, 15, "timeout", "runtime limit reached: ended by SIGTERM"),
    (60, 60.0, CLD_EXITED, 0, "timeout", "runtime limit reached: exited 0 after SIGTERM"),
    (60, 59.995, CLD_EXITED, 0, "timeout", "runtime limit reached: exited 0 after SIGTERM"),
    # It ended on its own before its limit, or had none: the timeout came after it (its ExecStopPost
    # under its CPU quota, a loaded VM guest), and the outcome is its own.
    (60, 5.0, CLD_EXITED, 0, "success", "exited 0"),
    (None, 5.0, CLD_EXITED, 0, "success", "exited 0"),
    (None, 5.0, CLD_EXITED, 3, "exit-code", "exited with status 3"),
    (None, 5.0, CLD_KILLED, 9, "signal", "killed by signal KILL"),
    (None, 5.0, CLD_DUMPED, 11, "core-dump", "killed by signal SEGV, core dumped"),
    (None, 5.0, CLD_EXITED, 203, "exit-code", "exited with status 203"),  # it was exec'd: its own status
    # No exit recorded: still a timeout, but not called a runtime limit it was not.
    (None, 5.0, 0, 0, "timeout", "systemd's stop timeout (TimeoutStopSec)"),
])
def test_a_timeout_result_is_the_runtime_limits_only_when_the_run_ran_that_long(
        runtime, ran_sec, code, status, outcome, reason):
    u = UnitState(name=NAME, active_state="failed", sub_state="failed", result="timeout", exec_main_code=code,
                  exec_main_status=status, invocation_id=INV, job_pending=False, active_enter_usec=ACTIVE_AT,
                  exec_main_exit_usec=ACTIVE_AT + round(ran_sec * 1_000_000))
    run = Run(id=RUN_ID, argv=["/bin/true"], runtime_max_sec=runtime)
    d = decide(run, make_attempt(started=True), u)
    after = "; systemd timed out after it ended (TimeoutStopSec: its ExecStopPost, or a stop from outside unitvisor)"
    assert (d.action, d.outcome.outcome, d.outcome.reason) == (
        Action.SETTLE, outcome, reason if outcome == "timeout" else reason + after)


def test_a_timeout_result_of_a_unit_never_active_is_its_start_timeout():
    """Type=exec: never active means never exec'd, whatever limit the run has."""
    for runtime in (None, 60):
        d = decide(Run(id=RUN_ID, argv=["/bin/true"], runtime_max_sec=runtime), make_attempt(started=True),
                   unit(active="failed", sub="failed", result="timeout", code=CLD_KILLED, status=15))
        assert d.outcome == Outcome("start-failed", "signal:TERM",
                                    "systemd's start timeout (TimeoutStartSec) passed before the command was started")


def test_setup_exit_of_a_unit_that_became_active_is_the_commands_own():
    # Type=exec: active only once execve() succeeded, so 203 is the command's own exit status.
    d = decide(make_run(), make_attempt(started=True),
               unit(active="failed", sub="failed", result="exit-code", code=CLD_EXITED, status=203,
                    active_enter_usec=1_700_000_000_000_000))
    assert d.outcome == Outcome("exit-code", "exit:203", "exited with status 203")


def test_setup_exit_of_a_unit_never_active_is_start_failed_until_proven():
    d = decide(make_run(), make_attempt(started=True),
               unit(active="failed", sub="failed", result="exit-code", code=CLD_EXITED, status=203))
    assert d.outcome.outcome == "start-failed"
    assert d.outcome.reason.endswith("not proven: the command may have exited with it itself")


@pytest.mark.parametrize("state", [EXITED_OK, FAILED_3,
                                   dict(active="failed", sub="failed", result="signal", code=CLD_KILLED, status=15)])
def test_ended_unit_with_cancel_requested_settles_cancelled(state):
    u = unit(**state)
    d = decide(make_run(cancelled=True), make_attempt(started=True), u)
    exit_text = {CLD_EXITED: f"exit:{state['status']}", CLD_KILLED: "signal:TERM"}[state["code"]]
    # What ended it, by the run's stop signal (TERM unless it names one; schema 026).
    how = {CLD_EXITED: f"exited {state['status']} after SIGTERM", CLD_KILLED: "ended by SIGTERM"}[state["code"]]
    assert d == Decision(Action.SETTLE, NAME, f"unit ended: cancelled by request: {how}",
                         Outcome("cancelled", exit_text, f"cancelled by request: {how}"), INV, u)


def test_ended_unit_without_invocation_id():
    d = decide(make_run(), make_attempt(started=True), unit(**FAILED_3, invocation_id=""))
    assert d.action is Action.SETTLE
    assert d.invocation_id is None


def test_decision_uses_the_attempts_unit_name():
    other = Attempt(run_id=RUN_ID, attempt=2, host_id="h1", unit_name=unit_name(RUN_ID, 2))
    assert decide(make_run(), other, None).unit_name == unit_name(RUN_ID, 2)
    assert decide(make_run(), other, unit(**RUNNING)).unit_name == unit_name(RUN_ID, 2)


def test_every_decision_for_an_open_attempt_is_one_of_the_attempt_actions():
    states = [None, unit(**RUNNING), unit(**EXITED_OK), unit(**FAILED_3), unit(active="inactive", sub="dead"),
              unit(**RUNNING, job=True)]
    attempts = [make_attempt(), make_attempt(started=True), make_attempt(started=True, invocation_id=INV)]
    seen = set()
    for cancelled in (False, True):
        for att in attempts:
            for state in states:
                d = decide(make_run(cancelled), att, state)
                seen.add(d.action)
                assert (d.outcome is not None) == (d.action in (Action.SETTLE, Action.GONE))
    assert seen == {Action.START, Action.ADOPT, Action.STOP, Action.SETTLE, Action.GONE, Action.NOTHING}


# -- between passes (decide_on_change) ---------------------------------------------------------------

def test_between_passes_a_started_attempts_running_unit_needs_no_write_for_its_invocation_id():
    """The daemon marked the unit it created as started without an invocation id: the unit's change
    writes nothing; the outcome or the next pass (decide) records the id."""
    d = decide_on_change(make_run(), make_attempt(started=True), unit(**RUNNING))
    assert d.action is Action.NOTHING
    assert "written with its outcome or by the next pass" in d.reason
    assert decide(make_run(), make_attempt(started=True), unit(**RUNNING)).action is Action.ADOPT


def test_between_passes_every_other_case_is_decide():
    """Exhaustive over the same grid as decide's: decide_on_change differs from decide only where an
    attempt already started would be adopted for its invocation id alone."""
    states = [None, unit(**RUNNING), unit(**EXITED_OK), unit(**FAILED_3), unit(active="inactive", sub="dead"),
              unit(**RUNNING, job=True), unit(active="deactivating", sub="stop-sigterm"),
              unit(**RUNNING, invocation_id="")]
    attempts = [make_attempt(), make_attempt(started=True), make_attempt(started=True, invocation_id=INV)]
    differ = 0
    for cancelled in (False, True):
        for att in attempts:
            for state in states:
                run = make_run(cancelled)
                full, between = decide(run, att, state), decide_on_change(run, att, state)
                if full.action is Action.ADOPT and att.started_at is not None:
                    assert between.action is Action.NOTHING and between.outcome is None
                    differ += 1
                else:
                    assert between == full
    # started, no invocation id recorded, run not cancelled, its unit running, with a job pending, or
    # stopping (not yet ended): left to the outcome or the pass
    assert differ == 3


# -- which changes are read with their rows (change_needs_rows) ---------------------------------------

@pytest.mark.parametrize(("state", "started", "needs"), [
    (None, True, True),  # the signals did not say all of its state: read in full, as before
    (unit(**RUNNING), True, False),
    (unit(**RUNNING, job=True), True, False),
    (unit(active="activating", sub="start"), True, False),
    (unit(active="deactivating", sub="stop-post"), True, False),
    (unit(**EXITED_OK), True, True),
    (unit(**FAILED_3), True, True),
    (unit(active="inactive", sub="dead"), True, True),
    (unit(**RUNNING), False, True),  # its attempt's mark may not be written (after the batch, or lost)
])
def test_a_change_is_read_with_its_rows_unless_a_started_attempts_unit_is_not_over(state, started, needs):
    assert change_needs_rows(NAME, state, {NAME} if started else set()) is needs


@pytest.mark.parametrize("state", [None, unit(**RUNNING), unit(**FAILED_3), unit(active="inactive", sub="dead")])
def test_a_change_of_a_unit_settled_here_is_never_read_with_its_rows(state):
    """Its outcome is written (never overwritten) and it was released: PID 1 collecting it (UnitRemoved,
    no state) or anything else it says of it leaves nothing to decide."""
    assert change_needs_rows(NAME, state, set(), {NAME}) is False
    assert change_needs_rows(NAME, state, {NAME}, {"another.service"}) is (state is None or state.has_ended)


def test_a_change_left_unread_is_one_that_decide_on_change_does_nothing_about():
    """The rule's premise, over decide's grid: where change_needs_rows says no, decide_on_change says
    NOTHING for a run not cancelled, whatever the attempt's rows hold. (A cancelled run's stop comes from
    the cancel channel: its NOTIFY, or the heartbeat's flag.)"""
    states = [unit(**RUNNING), unit(**EXITED_OK), unit(**FAILED_3), unit(active="inactive", sub="dead"),
              unit(**RUNNING, job=True), unit(active="deactivating", sub="stop-sigterm"),
              unit(active="activating", sub="start"), unit(**RUNNING, invocation_id="")]
    left = 0
    for att in (make_attempt(started=True), make_attempt(started=True, invocation_id=INV)):
        for state in states:
            if not change_needs_rows(NAME, state, {NAME}):
                assert decide_on_change(make_run(), att, state).action is Action.NOTHING
                left += 1
    assert left == 10  # five states not over, for each of the two started attempts


# -- units that no open attempt owns ----------------------------------------------------------------

SETTLED = store.UnitOwner("me", "exit-code")
OPEN_HERE = store.UnitOwner("me", None)
OPEN_ELSEWHERE = store.UnitOwner("other", None)


def orphan(owner, stop_orphans=True, running=False, awaiting_claim=False):
    return decide_orphan(NAME, owner, "me", stop_orphans, running, awaiting_claim)


@pytest.mark.parametrize("stop_orphans", [True, False])
def test_settled_attempts_ended_unit_is_released(stop_orphans):
    assert orphan(SETTLED, stop_orphans) == Decision(Action.RELEASE, NAME,
                                                     "outcome already recorded; releasing the unit",
                                                     keep_output=SETTLED.host_id == "me")


@pytest.mark.parametrize(("recorder", "keep_output"), [("me", True), ("declarer", False)])
def test_a_released_unit_has_its_tail_read_again_when_this_host_recorded_its_outcome(recorder, keep_output):
    """The release after the outcome's commit was cut short, and the tail's read may have been too."""
    assert orphan(store.UnitOwner(recorder, "success"), True).keep_output is keep_output


@pytest.mark.parametrize("stop_orphans", [True, False])
def test_settled_attempts_running_unit_is_stopped_as_stale(stop_orphans):
    """Taken over while this host was cut off (or cancelled and the stop not yet done): whatever the
    config says about orphans, a unit whose attempt is settled must not keep running."""
    d = orphan(store.UnitOwner("declarer", "lost"), stop_orphans, running=True)
    assert d.action is Action.STOP_STALE
    assert "lost" in d.reason and "declarer" in d.reason


def test_orphan_with_no_row_is_stopped():
    assert orphan(None) == Decision(Action.STOP_ORPHAN, NAME, "no attempt in the database owns this unit")


def test_orphan_is_left_by_config():
    assert orphan(None, stop_orphans=False) == Decision(
        Action.LEAVE_ORPHAN, NAME, "no attempt in the database owns this unit; left running by config")


@pytest.mark.parametrize("stop_orphans", [True, False])
@pytest.mark.parametrize("running", [True, False])
def test_a_unit_whose_attempt_is_open_on_another_host_is_never_stopped(stop_orphans, running):
    d = orphan(OPEN_ELSEWHERE, stop_orphans, running)
    assert d.action is Action.LEAVE_ORPHAN
    assert "open on host other" in d.reason


@pytest.mark.parametrize("stop_orphans", [True, False])
@pytest.mark.parametrize("running", [True, False])
def test_a_unit_held_by_a_host_whose_runs_this_one_may_not_read_is_never_stopped(stop_orphans, running):
    """unitvisor.unit_owners hides the host (and the outcome) of a run pinned to another host
    (sql/014_host_reads.sql): held elsewhere is still held."""
    d = orphan(store.UnitOwner(None, None), stop_orphans, running)
    assert d.action is Action.LEAVE_ORPHAN
    assert "open on another host" in d.reason


def test_a_unit_whose_hidden_attempt_ended_is_stopped_as_stale():
    d = orphan(store.UnitOwner(None, "ended"), running=True)
    assert d.action is Action.STOP_STALE
    assert "ended, recorded by another host" in d.reason


@pytest.mark.parametrize("running", [True, False])
def test_a_unit_claimed_by_this_host_while_the_pass_listed_units_is_left_alone(running):
    """The CLI's pass read the attempts, then the daemon claimed and started one, then the CLI listed
    units: the owner read after the listing says it is ours and open, so nothing is done."""
    assert orphan(OPEN_HERE, running=running).action is Action.NOTHING


def test_orphan_decisions_carry_no_outcome():
    for owner in (None, SETTLED, OPEN_HERE, OPEN_ELSEWHERE):
        for stop in (True, False):
            for running in (True, False):
                d = decide_orphan("unitvisor-run-x.service", owner, "me", stop, running)
                assert d.unit_name == "unitvisor-run-x.service"
                assert d.outcome is None
                assert d.invocation_id is None


def test_action_values():
    assert {a.name: a.value for a in Action} == {
        "NOTHING": "nothing", "START": "start", "ADOPT": "adopt", "STOP": "stop", "SETTLE": "settle", "GONE": "gone",
        "RELEASE": "release", "STOP_ORPHAN": "stop-orphan", "LEAVE_ORPHAN": "leave-orphan", "STOP_STALE": "stop-stale",
        "WAIT": "wait"}


def test_unit_ahead_of_its_claim_is_left_for_adoption_even_when_orphans_are_stopped():
    d = orphan(None, awaiting_claim=True, running=True)
    assert d.action is Action.LEAVE_ORPHAN
    assert "adopt" in d.reason
    assert orphan(SETTLED, awaiting_claim=True).action is Action.RELEASE


# -- RemainAfterExit=no with AddRef (issue 14) ------------------------------------------------------------

INACTIVE_OK = dict(active="inactive", sub="dead", result="success", code=CLD_EXITED, status=0)


@pytest.mark.parametrize("attempt", [make_attempt(), make_attempt(started=True),
                                     make_attempt(started=True, invocation_id=INV)])
def test_a_clean_end_held_inactive_dead_settles_success(attempt):
    # What a unit of this release shows after exit 0 while the daemon holds it (measured, systemd 252).
    u = unit(**INACTIVE_OK)
    assert decide(make_run(), attempt, u) == Decision(Action.SETTLE, NAME, "unit ended: exited 0",
                                                      Outcome("success", "exit:0", "exited 0"), INV, u)


def test_a_stopped_or_killed_unit_inactive_dead_with_result_success_is_a_signal_not_a_success():
    # systemctl stop, or a SIGTERM from outside: Result=success too, but the exit status tells.
    d = decide(make_run(), make_attempt(started=True),
               unit(active="inactive", sub="dead", result="success", code=CLD_KILLED, status=15))
    assert d.outcome == Outcome("signal", "signal:TERM", "killed by signal TERM")


def test_a_failed_unit_reset_by_hand_still_shows_its_exit_status():
    # `systemctl reset-failed` on a held failed unit turns it inactive/dead with Result=success, and
    # keeps ExecMainStatus (measured): the exit status decides, not the result.
    d = decide(make_run(), make_attempt(started=True),
               unit(active="inactive", sub="dead", result="success", code=CLD_EXITED, status=1))
    assert d.outcome.outcome == "exit-code"


def test_a_040_unit_active_exited_still_settles_success():
    # Started by 0.3.0 (RemainAfterExit=yes) and still loaded when the upgraded daemon starts.
    u = unit(**EXITED_OK)
    assert decide(make_run(), make_attempt(started=True), u).outcome == Outcome("success", "exit:0", "exited 0")


def test_a_gone_unit_of_a_cancelled_run_is_cancelled_whatever_the_journal_says():
    d = decide(make_run(cancelled=True), make_attempt(started=True), None)
    assert (d.action, d.outcome.outcome) == (Action.GONE, "cancelled")


@pytest.mark.parametrize(("listed", "expected"), [("inactive", "inactive"), ("failed", "failed"),
                                                  ("active", "active")])
def test_a_released_orphan_carries_the_state_it_was_listed_in(listed, expected):
    d = decide_orphan(NAME, SETTLED, "me", True, running=False, active_state=listed)
    assert (d.action, d.unit_state) == (Action.RELEASE, expected)

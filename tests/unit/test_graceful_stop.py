"""Graceful stop (schema 026): the unit's stop properties, the signal allowlist, the outcome's reason for a
stop, and the warnings before runtime_max_sec (when due, sent once, found again after a restart)."""

from __future__ import annotations

import dataclasses
import signal
import uuid
from datetime import UTC, datetime, timedelta
from unittest import mock

import pytest

from supervisor import stopsignals, store, unitspec
from supervisor.config import RunSettings, Settings
from supervisor.model import Attempt, Run
from supervisor.outcomes import CLD_EXITED, CLD_KILLED, Outcome, classify, stop_timed_out
from supervisor.reconciler import Action, Reconciler, decide
from supervisor.systemd import Systemd, UnitState

RUN_ID = uuid.UUID("12345678-9abc-4def-8123-456789abcdef")
NAME = unitspec.unit_name(RUN_ID, 1)
T0 = datetime(2026, 12, 2, 8, 0, tzinfo=UTC)
SETTINGS = Settings(runs=RunSettings(allowed_executables=("/bin/*",)))


def make_run(**values: object) -> Run:
    return Run(id=RUN_ID, argv=["/bin/true"], **values)


def make_attempt(started: bool = True, warned: bool = False) -> Attempt:
    return Attempt(run_id=RUN_ID, attempt=1, host_id="h1", unit_name=NAME, claimed_at=T0,
                   started_at=T0 if started else None, invocation_id="0" * 32 if started else None,
                   warned_at=T0 if warned else None)


# -- the unit's properties --------------------------------------------------------------------------

def test_a_run_without_stop_settings_has_the_unit_it_had_before():
    props = unitspec.build(make_run(), make_attempt(), SETTINGS)
    assert b"KillSignal" not in props and b"FinalKillSignal" not in props
    assert props[b"TimeoutStopUSec"] == SETTINGS.systemd.stop_grace * 1_000_000  # the host's stop_grace
    assert props[b"SendSIGKILL"] is True


def test_stop_signal_and_timeout_become_kill_signal_and_timeout_stop_then_sigkill():
    props = unitspec.build(make_run(stop_signal="INT", stop_timeout=70), make_attempt(), SETTINGS)
    assert props[b"KillSignal"] == signal.SIGINT
    assert props[b"TimeoutStopUSec"] == 70 * 1_000_000
    assert props[b"SendSIGKILL"] is True


def test_a_stop_timeout_past_the_cut_off_stops_bound_is_refused_where_the_fence_stops_runs():
    """The fence's stop of a cut-off host's runs must end within stop_grace (config.cut_off_after)."""
    fenced = dataclasses.replace(SETTINGS, fleet=dataclasses.replace(SETTINGS.fleet, stop_runs_when_cut_off=True))
    assert unitspec.stop_properties(make_run(stop_timeout=10), fenced)[b"TimeoutStopUSec"] == 10 * 1_000_000
    with pytest.raises(unitspec.Refused, match=r"stop_timeout 11 s is longer than this host's \[systemd\] stop_grace"):
        unitspec.stop_properties(make_run(stop_timeout=11), fenced)


@pytest.mark.parametrize("name", ["TERM", "SIGTERM", "sigterm", "term"])
def test_a_signal_is_taken_by_name_with_or_without_sig(name):
    assert unitspec.stop_properties(make_run(stop_signal=name), SETTINGS)[b"KillSignal"] == signal.SIGTERM


@pytest.mark.parametrize("name", ["SEGV", "STOP", "15", "", "TERM ", "SIGTERM\n", "RTMIN+1", "TERM,KILL"])
def test_a_signal_outside_the_list_is_refused_never_passed_on(name):
    """A row written past the database's check (it refuses these too) must not reach KillSignal=."""
    with pytest.raises(unitspec.Refused, match="stop_signal"):
        unitspec.build(make_run(stop_signal=name), make_attempt(), SETTINGS)


def test_a_warning_by_kill_or_an_unknown_name_is_refused_at_start():
    for name in ("KILL", "SEGV"):
        with pytest.raises(unitspec.Refused, match="warn_signal"):
            unitspec.build(make_run(runtime_max_sec=60, warn_before=10, warn_signal=name), make_attempt(), SETTINGS)


def test_every_allowed_name_is_a_signal_of_this_system():
    assert all(stopsignals.number(name) == getattr(signal, "SIG" + name) for name in stopsignals.SIGNALS)


# -- the outcome says which signal ended the run ------------------------------------------------------

def test_a_cancel_that_timed_out_into_sigkill_says_so():
    outcome = classify("timeout", CLD_KILLED, 9, cancel_requested=True, stop_signal="INT")
    assert outcome == Outcome("cancelled", "signal:KILL",
                              "cancelled by request: SIGINT did not end it within its stop timeout: killed by SIGKILL")
    assert stop_timed_out(outcome)


def test_a_cancel_ended_by_its_stop_signal_names_it():
    outcome = classify("success", CLD_KILLED, signal.SIGUSR1, cancel_requested=True, stop_signal="USR1")
    assert outcome.reason == "cancelled by request: ended by SIGUSR1"
    assert not stop_timed_out(outcome)


def test_a_run_that_exits_on_its_stop_signal_says_after_which():
    outcome = classify("success", CLD_EXITED, 0, cancel_requested=True, stop_signal="INT")
    assert outcome.reason == "cancelled by request: exited 0 after SIGINT"


def test_the_runtime_limit_says_how_the_stop_went():
    assert classify("timeout", CLD_KILLED, 15, cancel_requested=False, stop_signal="TERM").reason == (
        "runtime limit reached: ended by SIGTERM")
    killed = classify("timeout", CLD_KILLED, 9, cancel_requested=False, stop_signal="TERM")
    assert killed.reason == "runtime limit reached: SIGTERM did not end it within its stop timeout: killed by SIGKILL"
    assert stop_timed_out(killed)


def test_a_stop_by_kill_itself_did_not_time_out():
    assert not stop_timed_out(classify("success", CLD_KILLED, 9, cancel_requested=True, stop_signal="KILL"))


def test_an_oom_kill_is_no_stop():
    outcome = classify("oom-kill", CLD_KILLED, 9, cancel_requested=False, stop_signal="TERM")
    assert outcome.reason == "killed by the OOM killer" and not stop_timed_out(outcome)


def test_decide_passes_the_runs_stop_signal():
    unit = UnitState(name=NAME, active_state="failed", sub_state="failed", result="timeout", exec_main_code=CLD_KILLED,
                     exec_main_status=9, invocation_id="0" * 32, job_pending=False)
    d = decide(make_run(stop_signal="INT", cancel_requested_at=T0), make_attempt(), unit)
    assert d.action is Action.SETTLE
    assert d.outcome.reason.endswith("SIGINT did not end it within its stop timeout: killed by SIGKILL")


# -- warnings ------------------------------------------------------------------------------------------

def test_a_warning_is_due_warn_before_ahead_of_the_runtime_limit():
    w = stopsignals.warning(make_run(runtime_max_sec=60, warn_before=15, warn_signal="USR2"), make_attempt(), T0)
    assert (w.signal, w.due, w.before) == ("USR2", T0 + timedelta(seconds=45), 15)


@pytest.mark.parametrize(("run", "attempt"), [
    (make_run(runtime_max_sec=60), make_attempt()),  # none asked for
    (make_run(runtime_max_sec=60, warn_before=15), make_attempt(warned=True)),  # sent already
    (make_run(runtime_max_sec=60, warn_before=15, cancel_requested_at=T0), make_attempt()),  # being stopped
])
def test_no_warning(run, attempt):
    assert stopsignals.warning(run, attempt, T0) is None


@pytest.fixture
def systemd(mocker):
    fake = mocker.Mock(spec=Systemd)
    fake.start_transient.return_value = True
    fake.kill.return_value = True
    fake.list_units.return_value = {}
    return fake


@pytest.fixture
def marked(mocker):
    return mocker.patch.object(store, "mark_warned", return_value=True)


@pytest.fixture
def rec(mocker, systemd):
    for name in ("mark_started", "open_attempts", "unit_owners", "unclaimed_attempts", "record_output_tails"):
        mocker.patch.object(store, name, return_value=[] if name == "open_attempts" else {} if name == "unit_owners"
                            else set() if name == "unclaimed_attempts" else 0)
    return Reconciler(SETTINGS, store.Fence("h1", 3), mock.MagicMock(), systemd, journal=mock.Mock(),
                      cut_off_units=set())


def test_a_started_unit_is_warned_once_when_due_to_its_main_process(rec, systemd, marked):
    """Failed before the daemon sent warnings: nothing scheduled, nothing sent."""
    run = make_run(runtime_max_sec=60, warn_before=15)
    rec.start(run, make_attempt(started=False))
    due = rec.warnings.next_due()
    assert due is not None
    assert rec.send_due_warnings(due - timedelta(seconds=1)) == []
    systemd.kill.assert_not_called()
    [sent] = rec.send_due_warnings(due)
    systemd.kill.assert_called_once_with(NAME, "main", signal.SIGUSR1)
    assert marked.call_args.args[2].unit_name == NAME
    assert "sent SIGUSR1" in marked.call_args.args[3] and "warn_before 15 s" in marked.call_args.args[3]
    assert rec.send_due_warnings(due + timedelta(hours=1)) == []  # once
    assert systemd.kill.call_count == 1


def test_a_restarted_daemon_finds_the_due_time_from_the_units_start(rec, systemd, marked):
    run = make_run(runtime_max_sec=600, warn_before=60)
    started = datetime.now(UTC) - timedelta(seconds=100)
    systemd.state.return_value = UnitState(name=NAME, active_state="active", sub_state="running", result="success",
                                           exec_main_code=0, exec_main_status=0, invocation_id="0" * 32,
                                           job_pending=False, exec_main_start_usec=int(started.timestamp() * 1e6))
    rec.schedule_warnings([(run, make_attempt())])
    assert abs((rec.warnings.next_due() - (started + timedelta(seconds=540))).total_seconds()) < 0.001
    # Sent already (warned_at): never again, and its unit is not even read.
    systemd.state.reset_mock()
    other = stopsignals.Schedule()
    Reconciler(SETTINGS, store.Fence("h1", 3), mock.MagicMock(), systemd, journal=mock.Mock(),
               warnings=other).schedule_warnings([(run, make_attempt(warned=True))])
    assert len(other) == 0
    systemd.state.assert_not_called()


def test_a_late_warning_is_sent_at_once_and_says_it_is_late(rec, systemd, marked):
    run = make_run(runtime_max_sec=600, warn_before=60)
    rec.warnings.add(stopsignals.warning(run, make_attempt(), T0))
    rec.send_due_warnings(T0 + timedelta(seconds=540 + 30))
    assert "30 s late" in marked.call_args.args[3]


def test_a_settled_or_cancelled_attempts_warning_is_dropped(rec, systemd, marked):
    run = make_run(runtime_max_sec=600, warn_before=60)
    rec.warnings.add(stopsignals.warning(run, make_attempt(), T0))
    rec.schedule_warnings([(make_run(runtime_max_sec=600, warn_before=60, cancel_requested_at=T0), make_attempt())])
    assert len(rec.warnings) == 0
    rec.warnings.add(stopsignals.warning(run, make_attempt(), T0))
    rec.schedule_warnings([])  # no longer open here
    assert len(rec.warnings) == 0


def test_a_unit_gone_before_its_warning_gets_nothing_recorded(rec, systemd, marked):
    systemd.kill.return_value = False
    rec.warnings.add(stopsignals.warning(make_run(runtime_max_sec=60, warn_before=15), make_attempt(), T0))
    assert rec.send_due_warnings(T0 + timedelta(minutes=5)) == []
    marked.assert_not_called()

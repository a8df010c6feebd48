"""supervisor.reconciler.Reconciler carrying decisions out: the store's functions are mocks (each call
goes into one ordered log, with the connection's transactions), systemd is a Mock with Systemd's spec.

What is checked here is what the fleet relies on: a dead host's attempts settled in one transaction and
never touched through systemd, cut-off units settled as `lost`, orphans stopped only when no open
attempt anywhere owns them, and which errors end a pass and which stay with one run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import subprocess
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from unittest import mock

import psycopg
import pytest

from supervisor import fence, fleet, runenv, store
from supervisor import journal as journal_mod
from supervisor import reconciler as reconciler_mod
from supervisor.config import RunSettings, Settings, cut_off_after
from supervisor.model import Accounting, Attempt, Run
from supervisor.outcomes import CLD_EXITED, CLD_KILLED, Outcome
from supervisor.reconciler import UNPROVEN_LOST, Action, Decision, Reconciler
from supervisor.systemd import Systemd, SystemdError, SystemdUnavailable, UnitBrief, UnitRefused, UnitState
from supervisor.unitspec import unit_name

FENCE = store.Fence("me", 7)
T0 = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
INV = "0123456789abcdef0123456789abcdef"
RUNNING = UnitBrief("active", "running", False)
EXITED = UnitBrief("active", "exited", False)


def rid(n: int) -> uuid.UUID:
    return uuid.UUID(f"00000000-0000-4000-8000-{n:012d}")


def pair(n=1, host="me", started=True, cancelled=False, max_attempts=1, argv=("/bin/true",), retry_on=None,
         count_lost=True):
    # count_lost: a lost attempt uses up max_attempts, as before schema 27, so that these tests of what is
    # settled read as they did; the failure rules have tests of their own (tests/unit/test_failure_rules.py).
    run = Run(id=rid(n), argv=list(argv), max_attempts=max_attempts, retry_on=retry_on, count_lost=count_lost,
              cancel_requested_at=T0 if cancelled else None, state="running" if started else "starting")
    attempt = Attempt(run_id=rid(n), attempt=1, host_id=host, unit_name=unit_name(rid(n), 1), claimed_at=T0,
                      started_at=T0 if started else None, invocation_id=INV if started else None)
    return run, attempt


def ended(name, code=CLD_EXITED, status=0, result="success"):
    return UnitState(name, "active" if code == CLD_EXITED and status == 0 else "failed",
                     "exited" if code == CLD_EXITED and status == 0 else "failed", result, code, status, INV, False)


class FakeConn:
    """A connection whose transactions are entries in the shared log."""

    def __init__(self, log: list) -> None:
        self.log = log

    @contextlib.contextmanager
    def transaction(self):
        self.log.append("begin")
        try:
            yield
        except BaseException:
            self.log.append("rollback")
            raise
        self.log.append("commit")


@pytest.fixture
def log():
    return []


@pytest.fixture
def st(mocker, log):
    """Every store function the reconciler calls, logged in order; exceptions stay the real ones."""
    patched = {}
    defaults = {"open_attempts": [], "unit_owners": {}, "unclaimed_attempts": set(), "record_outcome": True,
                "mark_started": None, "record_event": None, "declare_dead": store.Declaration([]), "explain_waiting": 0,
                "expire_runs": 0, "record_outcomes": [True, True], "now": T0 + timedelta(seconds=30),
                "record_output_tails": 0, "pass_figures": store.PassFigures(0, {})}
    def logged(name, fake):
        def call(conn, *args, **kwargs):
            log.append((name, args, kwargs))
            return fake.return_value  # read at call time: a test may set it after the fixture
        return call

    for name, value in defaults.items():
        fake = mocker.patch.object(store, name, return_value=value)
        fake.side_effect = logged(name, fake)
        patched[name] = fake
    return mock.Mock(**patched)


@pytest.fixture
def systemd(mocker):
    fake = mocker.Mock(spec=Systemd)
    fake.list_units.return_value = {}
    fake.stop.return_value = True
    fake.reset_failed.return_value = True
    fake.start_transient.return_value = True
    fake.state.return_value = None
    return fake


@pytest.fixture
def events(mocker):
    return mocker.patch("supervisor.reconciler.event")


@pytest.fixture
def rec(st, systemd, log):
    settings = Settings(runs=RunSettings(allowed_executables=("/bin/*",), allowed_environment=("SECRET",)))
    journal = mock.Mock()
    journal.outcome.return_value = None
    journal.exec_evidence.return_value = None
    journal.unit_history.return_value = journal_mod.History.UNKNOWN
    journal.output_tails.return_value = [None]  # the unthreaded TailReader reads one at a time
    return Reconciler(settings, FENCE, FakeConn(log), systemd, journal=journal, cut_off_units=set())


def names(events):
    return [c.args[0] for c in events.call_args_list]


def labels(log):
    return [entry if isinstance(entry, str) else entry[0] for entry in log]


def recorded(st):
    """(attempt, outcome, next_state) of each record_outcome call."""
    return [(c.args[2], c.args[3], c.args[4]) for c in st.record_outcome.call_args_list]


# -- take_over_dead_hosts -------------------------------------------------------------------------

def test_take_over_settles_every_open_attempt_of_each_dead_host_in_one_transaction(rec, st, systemd, log, events):
    dead_a, dead_b = store.DeadHost("web-2", 75.0, 60.0), store.DeadHost("web-3", 90.0, 60.0)
    a1, a2 = pair(1, host="web-2"), pair(2, host="web-2", started=False)
    b1 = pair(3, host="web-3", cancelled=True)
    st.declare_dead.return_value = store.Declaration([dead_a, dead_b])
    attempts_of = {"web-2": [a1, a2], "web-3": [b1]}
    st.open_attempts.side_effect = lambda conn, host_id: (log.append(f"open_attempts {host_id}"),
                                                          attempts_of[host_id])[1]

    assert rec.take_over_dead_hosts(123.0) == [dead_a, dead_b]

    st.declare_dead.assert_called_once_with(rec.conn, FENCE, 123.0, 5)  # [fleet] max_dead_per_pass
    assert labels(log) == ["begin", "declare_dead",
                           "open_attempts web-2", "record_outcome", "record_outcome",
                           "open_attempts web-3", "record_outcome",
                           "commit"]
    assert recorded(st) == [
        (a1[1], fleet.takeover_outcome(a1[0], dead_a, "me"), "failed"),
        (a2[1], fleet.takeover_outcome(a2[0], dead_a, "me"), "failed"),
        (b1[1], fleet.takeover_outcome(b1[0], dead_b, "me"), "cancelled"),
    ]
    assert recorded(st)[2][1].outcome == "cancelled"
    for call in st.record_outcome.call_args_list:
        assert call.args[0] is rec.conn and call.args[1] == FENCE  # written as this host, with its fence
    assert systemd.mock_calls == []  # a dead host's units are on another machine: never ours to touch
    host_dead = [c for c in events.call_args_list if c.args[0] == "host-dead"]
    assert [(c.kwargs["host"], c.kwargs["runs_lost"]) for c in host_dead] == [("web-2", 2), ("web-3", 1)]
    assert host_dead[0].kwargs["level"] == logging.WARNING
    assert host_dead[0].kwargs["detail"] == "silent for 75s (host_dead_after 60s)"


def test_take_over_retries_a_run_with_attempts_left(rec, st):
    run, attempt = pair(1, host="web-2", max_attempts=3)
    st.declare_dead.return_value = store.Declaration([store.DeadHost("web-2", 61.0, 60.0)])
    st.open_attempts.return_value = [(run, attempt)]
    rec.take_over_dead_hosts(100.0)
    (call,) = st.record_outcome.call_args_list
    assert call.args[3].outcome == "lost"
    assert call.args[4] == "queued"
    assert timedelta(seconds=5) <= call.args[5] <= timedelta(seconds=10)  # retry_backoff_sec 10, jittered


def test_take_over_leaves_a_run_without_lost_in_retry_on_failed(rec, st):
    run, attempt = pair(1, host="web-2", max_attempts=3, retry_on=["exit-code"])
    st.declare_dead.return_value = store.Declaration([store.DeadHost("web-2", 61.0, 60.0)])
    st.open_attempts.return_value = [(run, attempt)]
    rec.take_over_dead_hosts(100.0)
    assert recorded(st) == [(attempt, fleet.takeover_outcome(run, store.DeadHost("web-2", 61.0, 60.0), "me"),
                             "failed")]
    assert st.record_outcome.call_args.args[5] is None


def test_take_over_with_no_dead_host_records_nothing(rec, st, systemd, log):
    assert rec.take_over_dead_hosts(5.0) == []
    assert labels(log) == ["begin", "declare_dead", "commit"]
    st.open_attempts.assert_not_called()
    st.record_outcome.assert_not_called()
    assert systemd.mock_calls == []


def test_take_over_is_all_or_nothing(rec, st, log, events):
    st.declare_dead.return_value = store.Declaration([store.DeadHost("web-2", 61.0, 60.0),
                                                      store.DeadHost("web-3", 61.0, 60.0)])
    attempts_of = {"web-2": [pair(1, host="web-2")], "web-3": [pair(2, host="web-3")]}
    st.open_attempts.side_effect = lambda conn, host_id: attempts_of[host_id]
    st.record_outcome.side_effect = [True, psycopg.OperationalError("server closed the connection")]
    with pytest.raises(psycopg.OperationalError):
        rec.take_over_dead_hosts(100.0)
    assert log[0] == "begin" and log[-1] == "rollback"
    # web-2's attempt was settled before web-3's failed, and rolled back with it: nobody was declared.
    assert [c for c in events.call_args_list if c.args[0] == "host-dead"] == []


def test_take_over_of_a_fenced_declarer_propagates(rec, st, log):
    st.declare_dead.side_effect = store.Fenced("host me is fenced")
    with pytest.raises(store.Fenced):
        rec.take_over_dead_hosts(100.0)
    assert log == ["begin", "rollback"]


def test_explain_waiting_asks_for_two_poll_intervals(rec, st):
    st.explain_waiting.return_value = 3
    assert rec.explain_waiting() == 3
    st.explain_waiting.assert_called_once_with(rec.conn, timedelta(seconds=20), fleet.EXPLAIN_BATCH)


def test_expire_overdue_asks_the_database_with_this_hosts_fence(rec, st):
    st.expire_runs.return_value = 2
    assert rec.expire_overdue() == 2
    st.expire_runs.assert_called_once_with(rec.conn, FENCE)


def test_pass_figures_asks_the_database_with_this_hosts_fence(rec, st):
    st.pass_figures.return_value = store.PassFigures(0, {"batch": (3, 20)})
    assert rec.pass_figures() == {"batch": (3, 20)}
    st.pass_figures.assert_called_once_with(rec.conn, FENCE)


def test_take_over_proposes_a_retry_of_a_lost_attempt_that_does_not_count(rec, st, log):
    """Schema 27: a dead host's attempt of a run without count_lost is retried past max_attempts 1."""
    dead = store.DeadHost("web-2", 75.0, 60.0)
    a1 = pair(1, host="web-2", count_lost=False)
    st.declare_dead.return_value = store.Declaration([dead])
    st.open_attempts.side_effect = lambda conn, host_id: [a1]
    rec.take_over_dead_hosts(123.0)
    [(attempt, outcome, state)] = recorded(st)
    assert (attempt, outcome.outcome, state) == (a1[1], "lost", "queued")


# -- units this host stopped while cut off --------------------------------------------------------

def test_a_cut_off_unit_that_ended_settles_as_lost_and_leaves_the_set(rec, st, systemd):
    run, attempt = pair(1)
    rec.cut_off_units.update({attempt.unit_name, "unitvisor-run-other-1.service"})
    systemd.state.return_value = ended(attempt.unit_name, CLD_KILLED, 15, "signal")
    decision = rec.reconcile_one(run, attempt)
    assert decision.action is Action.SETTLE and decision.outcome.outcome == "signal"
    ((got_attempt, outcome, state),) = recorded(st)
    assert got_attempt == attempt
    assert (outcome.outcome, outcome.exit_status) == ("lost", "signal:TERM")
    # the seconds in it are the subject of test_the_cut_off_reason_names_the_time_after_which_the_guard_stopped_it
    assert outcome.reason.startswith("stopped by this host after ")
    assert outcome.reason.endswith("s cut off from the database (stop_runs_when_cut_off)")
    assert state == "failed"
    assert rec.cut_off_units == {"unitvisor-run-other-1.service"}
    systemd.release.assert_called_once_with(attempt.unit_name, "failed")


def test_a_unit_seen_in_its_signals_is_decided_on_what_they_said(rec, st, systemd):
    run, attempt = pair(1)
    said = ended(attempt.unit_name, CLD_KILLED, 9, "signal")
    systemd.state.return_value = said  # the accounting added, as Systemd.state(name, seen) does
    assert rec.reconcile_one(run, attempt, said).outcome.outcome == "signal"
    systemd.state.assert_called_once_with(attempt.unit_name, said)


def test_a_cut_off_unit_that_exited_0_is_still_lost(rec, st, systemd):
    run, attempt = pair(1, max_attempts=2)
    rec.cut_off_units.add(attempt.unit_name)
    rec.apply(run, attempt, Decision(Action.SETTLE, attempt.unit_name, "ended",
                                     Outcome("success", "exit:0", "exited 0"), INV))
    ((_, outcome, state),) = recorded(st)
    assert (outcome.outcome, outcome.exit_status) == ("lost", "exit:0")
    assert state == "queued"  # retried, as any lost attempt with attempts left
    assert rec.cut_off_units == set()


def test_a_cut_off_unit_that_is_gone_is_lost(rec, st, systemd):
    run, attempt = pair(1)
    rec.cut_off_units.add(attempt.unit_name)
    rec.reconcile_one(run, attempt)  # systemd.state: None
    ((_, outcome, _),) = recorded(st)
    assert outcome.outcome == "lost" and "stop_runs_when_cut_off" in outcome.reason
    assert rec.cut_off_units == set()
    systemd.release.assert_not_called()


def test_a_cancelled_cut_off_unit_stays_cancelled(rec, st, systemd):
    run, attempt = pair(1, cancelled=True)
    rec.cut_off_units.add(attempt.unit_name)
    systemd.state.return_value = ended(attempt.unit_name, CLD_KILLED, 15, "signal")
    rec.reconcile_one(run, attempt)
    ((_, outcome, state),) = recorded(st)
    assert (outcome.outcome, state) == ("cancelled", "cancelled")
    assert rec.cut_off_units == set()


def test_a_unit_not_cut_off_keeps_its_outcome(rec, st, systemd):
    run, attempt = pair(1)
    rec.cut_off_units.add("unitvisor-run-other-1.service")
    systemd.state.return_value = ended(attempt.unit_name, CLD_KILLED, 15, "signal")
    rec.reconcile_one(run, attempt)
    ((_, outcome, _),) = recorded(st)
    assert outcome == Outcome("signal", "signal:TERM", "killed by signal TERM")
    assert rec.cut_off_units == {"unitvisor-run-other-1.service"}


@pytest.fixture
def unreadable_records(rec, tmp_path):
    """The fence's records as the daemon holds them, read from a directory it may not read (a daemon
    that is not root, once the root fence made /run/unitvisor its own)."""
    records = fence.FencedUnits(tmp_path / "fenced")
    with mock.patch.object(Path, "iterdir", side_effect=PermissionError(13, "Permission denied")):
        records.refresh()
    rec.cut_off_units = records
    return records


@pytest.mark.parametrize("unit_state", ["gone", "ended"])
def test_an_outcome_that_hangs_on_unreadable_fence_records_waits_for_a_later_pass(
        rec, st, systemd, events, unreadable_records, unit_state):
    """Killed by TERM, or gone: the fence may have stopped it, and then it is `lost` (retried), not
    `signal`. Unknown: left open, said with the run id, and the pass goes on."""
    run, attempt = pair(1)
    if unit_state == "ended":
        systemd.state.return_value = ended(attempt.unit_name, CLD_KILLED, 15, "signal")
    rec.isolated(run, attempt, lambda: rec.reconcile_one(run, attempt))  # as the pass and the daemon call it
    assert recorded(st) == []
    ((_, said),) = [(c.args, c.kwargs) for c in events.call_args_list if c.args[0] == "outcome-deferred"]
    assert said["run"] == run.id and "cannot read the fence's records" in said["detail"]
    assert "Permission denied" in said["detail"] and "whether the fence stopped it is unknown" in said["detail"]


def test_a_cancelled_run_is_settled_whatever_the_fence_records(rec, st, systemd, unreadable_records):
    run, attempt = pair(1, cancelled=True)
    systemd.state.return_value = ended(attempt.unit_name, CLD_KILLED, 15, "signal")
    rec.reconcile_one(run, attempt)
    ((_, outcome, state),) = recorded(st)
    assert (outcome.outcome, state) == ("cancelled", "cancelled")


@pytest.mark.parametrize(("fields", "key", "labelled"), [
    ({}, False, False),
    ({"concurrency_key": "deploy"}, True, False),
    ({"labels": {"team": "batch"}}, False, True),
])
def test_a_recorded_outcome_says_whether_it_may_have_freed_a_held_run(rec, st, systemd, fields, key, labelled):
    """What the daemon's claim after a settle reads (Daemon._claim_after_settle)."""
    run, attempt = pair(1)
    run = dataclasses.replace(run, **fields)
    systemd.state.return_value = ended(attempt.unit_name)
    rec.reconcile_one(run, attempt)
    assert len(recorded(st)) == 1
    assert (rec.freed_key, rec.freed_labelled) == (key, labelled)


def test_the_cut_off_set_is_the_one_passed_in():
    """The daemon passes the guard's set: the guard adds, the reconciler removes, one object."""
    shared: set[str] = set()
    rec = Reconciler(Settings(), FENCE, mock.Mock(), mock.Mock(spec=Systemd), cut_off_units=shared)
    assert rec.cut_off_units is shared
    assert Reconciler(Settings(), FENCE, mock.Mock(), mock.Mock(spec=Systemd)).cut_off_units == set()


def test_the_cut_off_reason_names_the_time_after_which_the_guard_stopped_it(rec, st, systemd):
    run, attempt = pair(1)
    rec.cut_off_units.add(attempt.unit_name)
    systemd.state.return_value = ended(attempt.unit_name, CLD_KILLED, 15, "signal")
    rec.reconcile_one(run, attempt)
    ((_, outcome, _),) = recorded(st)
    assert f"after {cut_off_after(rec.settings):.0f}s cut off" in outcome.reason


# -- orphans --------------------------------------------------------------------------------------

ORPHAN = unit_name(rid(90), 1)


@pytest.mark.parametrize(("action", "calls", "level"), [
    # release() with no state: a stop job, reset-failed, and this daemon's reference dropped
    (Action.STOP_ORPHAN, ["release"], logging.WARNING),
    (Action.STOP_STALE, ["release"], logging.WARNING),
    (Action.RELEASE, ["release"], logging.INFO),
    (Action.LEAVE_ORPHAN, [], logging.WARNING),
    (Action.NOTHING, [], None),
])
def test_apply_orphan(rec, systemd, events, action, calls, level):
    rec.apply_orphan(Decision(action, ORPHAN, "why"))
    assert [c[0] for c in systemd.method_calls] == calls
    for call in systemd.method_calls:
        assert call.args in ((ORPHAN,), (ORPHAN, None))
    if level is None:
        events.assert_not_called()
    else:
        events.assert_called_once_with(action.value, unit=ORPHAN, detail="why", level=level)


def test_orphans_asks_for_owners_only_of_units_not_owned(rec, st, systemd):
    run, attempt = pair(1)
    other_a, other_b = unit_name(rid(91), 1), unit_name(rid(92), 2)
    units = {attempt.unit_name: RUNNING, other_a: RUNNING, other_b: EXITED}
    rec._orphans(units, {attempt.unit_name})
    st.unit_owners.assert_called_once_with(rec.conn, [other_a, other_b])
    st.unclaimed_attempts.assert_called_once_with(rec.conn, [(rid(91), 1), (rid(92), 2)])


def test_orphans_with_every_unit_owned_asks_nothing(rec, st):
    run, attempt = pair(1)
    assert rec._orphans({attempt.unit_name: RUNNING}, {attempt.unit_name}) == []
    st.unit_owners.assert_not_called()
    st.unclaimed_attempts.assert_not_called()


@pytest.mark.parametrize(("brief", "action"), [
    (RUNNING, Action.STOP_STALE),
    (UnitBrief("activating", "start", True), Action.STOP_STALE),
    (UnitBrief("deactivating", "stop-sigterm", True), Action.STOP_STALE),
    (EXITED, Action.RELEASE),
    (UnitBrief("failed", "failed", False), Action.RELEASE),
    (UnitBrief("inactive", "dead", False), Action.RELEASE),
])
def test_orphans_pass_running_from_the_unit_listing(rec, st, brief, action):
    st.unit_owners.return_value = {ORPHAN: store.UnitOwner("web-2", "lost")}
    (decision,) = rec._orphans({ORPHAN: brief}, set())
    assert decision.action is action
    st.unclaimed_attempts.assert_called_once_with(rec.conn, [])  # a unit with a row is never "ahead of its claim"


def test_a_unit_open_on_another_host_is_left_running(rec, st, systemd, events):
    st.unit_owners.return_value = {ORPHAN: store.UnitOwner("web-2", None)}
    systemd.list_units.return_value = {ORPHAN: RUNNING}
    done = rec.reconcile_pass()
    assert [p.decision.action for p in done] == [Action.LEAVE_ORPHAN]
    systemd.stop.assert_not_called()
    systemd.reset_failed.assert_not_called()
    systemd.release.assert_not_called()


def test_reconcile_pass_stops_a_unit_with_no_row_and_a_stale_one(rec, st, systemd):
    stale = unit_name(rid(93), 1)
    st.unit_owners.return_value = {stale: store.UnitOwner("me", "lost")}
    systemd.list_units.return_value = {ORPHAN: RUNNING, stale: RUNNING}
    done = rec.reconcile_pass()
    assert [(p.decision.action, p.decision.unit_name) for p in done] == [
        (Action.STOP_ORPHAN, ORPHAN), (Action.STOP_STALE, stale)]
    assert systemd.release.call_args_list == [mock.call(ORPHAN), mock.call(stale)]
    st.record_outcome.assert_not_called()  # an outcome already recorded is never merged


def test_orphans_of_a_unit_ahead_of_its_claim_is_left(rec, st, systemd):
    st.unclaimed_attempts.return_value = {(rid(90), 1)}
    (decision,) = rec._orphans({ORPHAN: RUNNING}, set())
    assert decision.action is Action.LEAVE_ORPHAN


# -- which errors stay with one run ---------------------------------------------------------------

@pytest.mark.parametrize("error", [
    SystemdUnavailable("starting x: systemd is not reachable over D-Bus"),
])
def test_systemd_unavailable_from_a_start_ends_the_pass(rec, systemd, error):
    run, attempt = pair(1, started=False)
    systemd.start_transient.side_effect = error
    with pytest.raises(SystemdUnavailable):
        rec.isolated(run, attempt, lambda: rec.start(run, attempt))


@pytest.mark.parametrize("error", [
    store.DatabaseUnavailable("cannot connect"),
    psycopg.OperationalError("server closed the connection unexpectedly"),
    psycopg.InterfaceError("the connection is closed"),
])
def test_a_lost_database_from_a_start_ends_the_pass(rec, st, systemd, error):
    assert isinstance(error, store.CONNECTION_LOST)
    run, attempt = pair(1, started=False)
    st.mark_started.side_effect = error
    with pytest.raises(type(error)):
        rec.isolated(run, attempt, lambda: rec.start(run, attempt))
    systemd.start_transient.assert_called_once()


def test_a_systemd_error_stays_with_its_run(rec, st, systemd, events):
    run, attempt = pair(1, cancelled=True)
    systemd.stop.side_effect = SystemdError("StopUnit x: Access denied")
    rec.isolated(run, attempt, lambda: rec.apply(run, attempt, Decision(Action.STOP, attempt.unit_name, "cancel")))
    events.assert_called_once_with("systemd-error", level=logging.ERROR, run=run.id, attempt=1,
                                   unit=attempt.unit_name, detail="StopUnit x: Access denied")


def test_any_other_exception_stays_with_its_run(rec, st, events):
    run, attempt = pair(1)
    st.record_outcome.side_effect = KeyError("column")
    rec.isolated(run, attempt, lambda: rec.settle(run, attempt, Outcome("success", "exit:0", "exited 0")))
    events.assert_called_once_with("internal-error", level=logging.ERROR, run=run.id, attempt=1,
                                   unit=attempt.unit_name, detail="KeyError: 'column'")


def test_a_unit_refused_by_systemd_settles_start_failed(rec, st, systemd):
    run, attempt = pair(1, started=False)
    systemd.start_transient.side_effect = UnitRefused("bad property")
    rec.isolated(run, attempt, lambda: rec.start(run, attempt))
    ((_, outcome, state),) = recorded(st)
    assert (outcome.outcome, state) == ("start-failed", "failed")
    systemd.release.assert_not_called()


def test_a_pass_goes_on_after_one_runs_error(rec, st, systemd, events):
    (r1, a1), (r2, a2) = pair(1, started=False), pair(2, started=False)
    st.open_attempts.return_value = [(r1, a1), (r2, a2)]
    systemd.start_transient.side_effect = [RuntimeError("boom"), True]
    done = rec.reconcile_pass()
    assert [p.run for p in done] == [r2]
    assert systemd.start_transient.call_count == 2
    assert names(events)[0] == "internal-error" and events.call_args_list[0].kwargs["run"] == r1.id


def test_fenced_ends_the_pass(rec, st, systemd):
    run, attempt = pair(1, started=False)
    st.mark_started.side_effect = store.Fenced("host me is fenced: its epoch 7 is over")
    with pytest.raises(store.Fenced):
        rec.isolated(run, attempt, lambda: rec.start(run, attempt))


# -- the run's environment: a root-only file, written before the start, gone after the outcome ----

def with_env(n=1, env=None, **kwargs):
    run, attempt = pair(n, **kwargs)
    return dataclasses.replace(run, environment=env if env is not None else {"SECRET": "s3cr3t $x"}), attempt


def test_a_start_writes_the_environment_file_and_names_it_not_the_values(rec, st, systemd, environment_directory):
    run, attempt = with_env(started=False)
    rec.start(run, attempt)
    (name, props), _ = systemd.start_transient.call_args
    path = environment_directory / f"{attempt.unit_name}.env"
    assert props[b"EnvironmentFiles"] == [(str(path).encode(), False)]
    assert b"Environment" not in props
    assert b"s3cr3t" not in repr(props).encode()
    assert path.read_text() == 'SECRET="s3cr3t \\$x"\n'


def test_a_start_without_environment_writes_no_file(rec, st, systemd, environment_directory):
    run, attempt = with_env(env={}, started=False)
    rec.start(run, attempt)
    assert b"EnvironmentFiles" not in systemd.start_transient.call_args.args[1]
    assert not environment_directory.exists() or os.listdir(environment_directory) == []


def test_the_outcome_removes_the_file(rec, st, systemd, environment_directory):
    run, attempt = with_env(started=False)
    rec.start(run, attempt)
    assert os.listdir(environment_directory) == [f"{attempt.unit_name}.env"]
    rec.settle(run, attempt, Outcome("success", "exit:0", "exited 0"))
    assert os.listdir(environment_directory) == []


def test_a_refused_start_removes_the_file(rec, st, systemd, environment_directory):
    run, attempt = with_env(started=False)
    systemd.start_transient.side_effect = UnitRefused("bad property")
    rec.start(run, attempt)
    assert [o.outcome for _, o, _ in recorded(st)] == ["start-failed"]
    assert os.listdir(environment_directory) == []


def test_a_run_with_a_refused_name_is_refused_before_any_file(rec, st, systemd, environment_directory):
    run, attempt = with_env(env={"LD_PRELOAD": "/tmp/evil.so", "OK": "1"}, started=False)
    rec.start(run, attempt)
    ((_, outcome, state),) = recorded(st)
    assert (outcome.outcome, state) == ("refused", "failed")
    assert outcome.reason.startswith("environment name LD_PRELOAD is refused: the dynamic loader")
    systemd.start_transient.assert_not_called()
    assert not environment_directory.exists()


def test_an_unreachable_systemd_keeps_the_file_for_the_retry(rec, st, systemd, environment_directory):
    run, attempt = with_env(started=False)
    systemd.start_transient.side_effect = SystemdUnavailable("gone")
    with pytest.raises(SystemdUnavailable):
        rec.start(run, attempt)
    assert os.listdir(environment_directory) == [f"{attempt.unit_name}.env"]  # the attempt is still open


def test_the_sweep_removes_files_whose_attempt_is_not_open_here(rec, st, environment_directory, events):
    files = runenv.EnvironmentFiles()
    units = {key: unit_name(rid(n), 1) for n, key in enumerate(
        ("open", "settled", "elsewhere", "no-row", "open-temp", "settled-temp"), start=1)}
    for key in ("open", "settled", "elsewhere", "no-row"):
        files.write(units[key], {"A": key})
    temp = ".{}.env.0123456789abcdef.tmp"
    (environment_directory / temp.format(units["open-temp"])).write_text("")
    (environment_directory / temp.format(units["settled-temp"])).write_text("")
    (environment_directory / "stray").write_text("")
    st.unit_owners.return_value = {
        units["open"]: store.UnitOwner("me", None), units["open-temp"]: store.UnitOwner("me", None),
        units["settled"]: store.UnitOwner("me", "success"),
        units["settled-temp"]: store.UnitOwner("me", "lost"),
        units["elsewhere"]: store.UnitOwner("other", None),
    }
    removed = rec.sweep_environment_files()
    kept = sorted([f"{units['open']}.env", temp.format(units["open-temp"])])
    assert sorted(os.listdir(environment_directory)) == kept
    assert len(removed) == 5
    assert names(events) == ["environment-file-removed"] * 5


def test_the_sweep_lists_files_before_it_reads_the_rows(rec, st, log, environment_directory):
    """A file listed is one whose attempt's row was committed before it was written: reading the rows
    after the listing sees that attempt open, so a claim racing the sweep never loses its file."""
    unit = unit_name(rid(1), 1)
    runenv.EnvironmentFiles().write(unit, {"A": "1"})
    st.unit_owners.return_value = {unit: store.UnitOwner("me", None)}
    assert rec.sweep_environment_files() == []
    assert [entry[1] for entry in log if entry[0] == "unit_owners"] == [([unit],)]
    assert os.listdir(environment_directory) == [f"{unit}.env"]


def test_the_sweep_with_no_files_asks_nothing(rec, st):
    assert rec.sweep_environment_files() == []
    st.unit_owners.assert_not_called()


def test_a_pass_sweeps(rec, st, environment_directory):
    runenv.EnvironmentFiles().write(unit_name(rid(9), 1), {"A": "1"})
    rec.reconcile_pass()
    assert os.listdir(environment_directory) == []


def test_an_unreadable_directory_is_reported_not_fatal(rec, st, mocker, events):
    mocker.patch.object(runenv.EnvironmentFiles, "listing", side_effect=PermissionError(13, "Permission denied"))
    assert rec.sweep_environment_files() == []
    assert names(events) == ["environment-files-unreadable"]


# -- units held by the daemon's reference (RemainAfterExit=no, AddRef) -----------------------------------

JOURNAL_SUCCESS = journal_mod.Found(Outcome("success", "exit:0", "exited 0 (from the journal)"),
                                    datetime(2024, 5, 1, 12, 0, 5, tzinfo=UTC),
                                    Accounting(cpu_usage_nsec=1_500_000_000))


def test_an_unstarted_attempt_whose_unit_the_journal_knows_is_never_started_again(rec, st, systemd):
    # A daemon died between its StartTransientUnit and recording it; the unit ended and was collected.
    run, attempt = pair(1, started=False)
    rec.journal.unit_history.return_value = journal_mod.History.KNOWN
    rec.journal.outcome.return_value = JOURNAL_SUCCESS
    st.open_attempts.return_value = [(run, attempt)]
    (done,) = rec.reconcile_pass()
    assert done.decision.action is Action.GONE
    systemd.start_transient.assert_not_called()
    rec.journal.unit_history.assert_called_once_with(attempt.unit_name, mock.ANY)
    rec.journal.outcome.assert_called_once_with(attempt.unit_name, None)
    ((_, outcome, state),) = recorded(st)
    assert (outcome, state) == (JOURNAL_SUCCESS.outcome, "succeeded")
    assert st.record_outcome.call_args.kwargs["accounting"] == JOURNAL_SUCCESS.accounting
    assert st.record_outcome.call_args.kwargs["ended_at"] == JOURNAL_SUCCESS.ended_at
    systemd.release.assert_not_called()


def test_an_unstarted_attempt_unknown_to_a_journal_that_reaches_back_to_its_claim_is_started(rec, st, systemd):
    run, attempt = pair(1, started=False)
    rec.journal.unit_history.return_value = journal_mod.History.UNKNOWN
    st.open_attempts.return_value = [(run, attempt)]
    rec.reconcile_pass()
    systemd.start_transient.assert_called_once()
    systemd.state.assert_not_called()  # nothing to adopt needs asking: it is started (or adopted) either way


def test_a_unit_that_exists_but_is_collected_before_the_ref_is_gone_not_started_again(rec, st, systemd):
    run, attempt = pair(1, started=False)
    systemd.start_transient.return_value = False  # UnitExists
    systemd.ref.return_value = False  # ended and collected since
    rec.journal.outcome.return_value = JOURNAL_SUCCESS
    rec.start(run, attempt)
    systemd.state.assert_not_called()
    assert systemd.start_transient.call_count == 1
    ((_, outcome, _),) = recorded(st)
    assert outcome == JOURNAL_SUCCESS.outcome


def test_an_existing_unit_is_held_before_its_state_is_read(rec, st, systemd):
    run, attempt = pair(1, started=False)
    systemd.start_transient.return_value = False
    systemd.ref.return_value = True
    systemd.state.return_value = UnitState(attempt.unit_name, "active", "running", "success", 0, 0, INV, False)
    rec.start(run, attempt)
    assert [c[0] for c in systemd.method_calls] == ["start_transient", "ref", "state"]


def test_a_pass_holds_every_listed_unit_of_an_open_attempt(rec, st, systemd):
    run, attempt = pair(1)
    st.open_attempts.return_value = [(run, attempt)]
    systemd.list_units.return_value = {attempt.unit_name: RUNNING}
    systemd.ref.return_value = True
    (done,) = rec.reconcile_pass()
    assert done.decision.action is Action.NOTHING
    systemd.ref.assert_called_once_with(attempt.unit_name)


def test_a_dry_run_holds_nothing(rec, st, systemd):
    run, attempt = pair(1)
    st.open_attempts.return_value = [(run, attempt)]
    systemd.list_units.return_value = {attempt.unit_name: RUNNING}
    rec.plan()
    systemd.ref.assert_not_called()


def test_a_listed_unit_collected_before_the_ref_is_decided_as_gone(rec, st, systemd):
    run, attempt = pair(1)
    st.open_attempts.return_value = [(run, attempt)]
    systemd.list_units.return_value = {attempt.unit_name: RUNNING}
    systemd.ref.return_value = False
    rec.journal.outcome.return_value = JOURNAL_SUCCESS
    (done,) = rec.reconcile_pass()
    assert done.decision.action is Action.GONE
    systemd.state.assert_not_called()
    assert recorded(st)[0][1] == JOURNAL_SUCCESS.outcome


@pytest.mark.parametrize(("active", "sub", "code", "status", "result"), [
    ("inactive", "dead", CLD_EXITED, 0, "success"),
    ("failed", "failed", CLD_EXITED, 3, "exit-code"),
    ("active", "exited", CLD_EXITED, 0, "success"),  # a unit of 0.3.0
])
def test_a_settled_unit_is_released_by_the_state_it_ended_in(rec, st, systemd, active, sub, code, status, result):
    run, attempt = pair(1)
    systemd.state.return_value = UnitState(attempt.unit_name, active, sub, result, code, status, INV, False)
    rec.reconcile_one(run, attempt)
    systemd.release.assert_called_once_with(attempt.unit_name, active)


def test_a_released_orphan_is_released_by_its_listed_state(rec, systemd):
    rec.apply_orphan(Decision(Action.RELEASE, ORPHAN, "why", unit_state="inactive"))
    systemd.release.assert_called_once_with(ORPHAN, "inactive")


def test_a_unit_the_journal_knows_and_that_is_loaded_now_is_adopted_not_lost(rec, st, systemd):
    """The pass's listing predates a unit the daemon started since (`unitvisor reconcile` by hand beside
    it): the journal knows it because it runs. Asked again, live, it is loaded: start, i.e. adopt."""
    run, attempt = pair(1, started=False)
    rec.journal.unit_history.return_value = journal_mod.History.KNOWN
    systemd.list_units.return_value = {}
    systemd.state.return_value = UnitState(attempt.unit_name, "active", "running", "success", 0, 0, INV, False)
    systemd.start_transient.return_value = False  # UnitExists: adoption
    systemd.ref.return_value = True
    st.open_attempts.return_value = [(run, attempt)]
    rec.reconcile_pass()
    systemd.start_transient.assert_called_once()
    assert recorded(st) == []
    rec.journal.outcome.assert_not_called()


# -- outcomes of units that ended together: one statement ------------------------------------------

def _ended_pair(rec, systemd, n, status=0):
    run, attempt = pair(n)
    systemd.state.return_value = ended(attempt.unit_name, CLD_EXITED, status, "success" if status == 0 else "exit-code")
    rec.reconcile_one(run, attempt)
    return run, attempt


def test_outcomes_settled_in_a_batch_are_written_in_one_statement_then_released(rec, st, systemd, log, events):
    systemd.release.side_effect = lambda name, state=None: log.append(("release", (name,), {}))
    with rec.batched_outcomes():
        _, first = _ended_pair(rec, systemd, 1)
        _, second = _ended_pair(rec, systemd, 2, status=3)
        assert "record_outcomes" not in labels(log) and not st.record_outcome.called
        systemd.release.assert_not_called()  # the unit is the only record of the outcome until it is written
    assert labels(log) == ["record_outcomes", "release", "release"]
    [(_, (fence, settlings), _)] = [e for e in log if e[0] == "record_outcomes"]
    assert fence == FENCE
    assert [(s.attempt, s.outcome.outcome, s.next_state) for s in settlings] == [
        (first, "success", "succeeded"), (second, "exit-code", "failed")]
    assert [c.args[0] for c in systemd.release.call_args_list] == [first.unit_name, second.unit_name]
    assert names(events).count("settled") == 2 and rec.settled == 2
    st.record_outcome.assert_not_called()


def test_a_batch_counts_only_the_outcomes_it_took(rec, st, systemd, events):
    st.record_outcomes.return_value = [False, True]  # the first had an outcome already (another writer)
    with rec.batched_outcomes():
        _ended_pair(rec, systemd, 1)
        _ended_pair(rec, systemd, 2)
    assert names(events).count("settled") == 1 and rec.settled == 1
    assert systemd.release.call_count == 2  # both units are done with either way


def test_a_batch_of_one_is_the_single_statement(rec, st, systemd):
    with rec.batched_outcomes():
        _, attempt = _ended_pair(rec, systemd, 1)
    assert [c.args[2] for c in st.record_outcome.call_args_list] == [attempt]
    st.record_outcomes.assert_not_called()


def test_a_row_the_database_refuses_costs_the_batch_nothing_but_a_retry_one_by_one(rec, st, systemd, events):
    st.record_outcomes.side_effect = psycopg.errors.CheckViolation("attempts_accounting_valid")
    st.record_outcome.side_effect = [psycopg.errors.CheckViolation("attempts_accounting_valid"), True]
    with rec.batched_outcomes():
        _, bad = _ended_pair(rec, systemd, 1)
        _, good = _ended_pair(rec, systemd, 2)
    assert "outcome-batch-refused" in names(events)
    assert [c.args[2] for c in st.record_outcome.call_args_list] == [bad, good]
    # the refused one keeps its unit for the next pass
    assert [c.args[0] for c in systemd.release.call_args_list] == [good.unit_name]
    assert names(events).count("internal-error") == 1 and rec.settled == 1


@pytest.mark.parametrize("error", [store.Fenced("host me is fenced: epoch 7 is over"),
                                   psycopg.OperationalError("server closed the connection")])
def test_a_fenced_or_lost_batch_releases_nothing(rec, st, systemd, error):
    st.record_outcomes.side_effect = error
    with pytest.raises(type(error)), rec.batched_outcomes():
        _ended_pair(rec, systemd, 1)
        _ended_pair(rec, systemd, 2)
    systemd.release.assert_not_called()
    assert rec.settled == 0


def test_a_batch_cut_short_by_the_bus_still_records_what_was_read(rec, st, systemd):
    with pytest.raises(SystemdUnavailable), rec.batched_outcomes():
        _ended_pair(rec, systemd, 1)
        _ended_pair(rec, systemd, 2)
        systemd.state.side_effect = SystemdUnavailable("bus gone")
        rec.isolated(*pair(3), lambda: rec.reconcile_one(*pair(3)))
    assert st.record_outcomes.call_count == 1 and len(st.record_outcomes.call_args.args[2]) == 2


# -- issue 21: a journal that cannot be read never starts an attempt twice --------------------------------
# A real Journal, journalctl failing at its boundary; the pure decision and Journal.unit_history are in
# test_journal_unreadable.py.

def completed(stdout: str = "", returncode: int = 0) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess([], returncode, stdout=stdout, stderr="")


def old_record(at: datetime) -> str:
    return json.dumps({"_PID": "1", "__REALTIME_TIMESTAMP": str(int(at.timestamp() * 1_000_000))}) + "\n"


@pytest.fixture
def real_journal(rec, mocker):
    rec.journal = journal_mod.Journal(timeout=0.5, settle_wait=0.0)
    mocker.patch.object(journal_mod, "_boot_started", return_value=(T0 - timedelta(days=1)).timestamp())
    return rec


@pytest.mark.parametrize("failure", [
    subprocess.TimeoutExpired(["journalctl"], 0.5),
    FileNotFoundError(2, "No such file or directory", "journalctl"),
    completed("", 1),
    completed("Journal file /var/log/journal/x/system.journal is truncated, ignoring file.\n", 0),
], ids=["timeout", "missing", "failed", "garbage"])
def test_an_unreadable_journal_never_starts_an_attempt_a_second_time(real_journal, st, systemd, mocker, events,
                                                                     failure):
    """The daemon died right after StartTransientUnit (kill point after-start); the unit ended cleanly and
    PID 1 collected it; the database still says `starting`. On 0.5.1 this pass started it again."""
    rec = real_journal
    run, attempt = pair(1, started=False)
    st.open_attempts.return_value = [(run, attempt)]
    mocker.patch.object(journal_mod.subprocess, "run", side_effect=failure if isinstance(failure, Exception)
                        else lambda *a, **k: failure)
    (done,) = rec.reconcile_pass()
    assert done.decision.action is Action.WAIT
    systemd.start_transient.assert_not_called()
    assert recorded(st) == [] and not st.record_outcomes.called  # nothing settled either: a later pass decides
    assert "journal-unreadable" in names(events)
    assert rec.in_flight == 1  # its slot stays taken


def test_a_vacuumed_journal_never_starts_an_attempt_a_second_time_and_settles_it_lost(real_journal, st, systemd,
                                                                                     mocker):
    rec = real_journal
    run, attempt = pair(1, started=False, max_attempts=2)
    st.open_attempts.return_value = [(run, attempt)]
    mocker.patch.object(journal_mod.subprocess, "run", return_value=completed())  # nothing at all, so nothing old
    (done,) = rec.reconcile_pass()
    assert done.decision.action is Action.GONE
    systemd.start_transient.assert_not_called()
    ((got, outcome, state),) = recorded(st)
    assert (got, outcome, state) == (attempt, UNPROVEN_LOST, "queued")  # a retry is a new attempt number


def test_a_journal_that_reaches_back_and_knows_nothing_lets_it_start(real_journal, st, systemd, mocker):
    rec = real_journal
    run, attempt = pair(1, started=False)
    st.open_attempts.return_value = [(run, attempt)]
    old = old_record(T0 - timedelta(hours=1))
    fake = mocker.patch.object(journal_mod.subprocess, "run", side_effect=[completed(), completed(old)])
    rec.reconcile_pass()
    systemd.start_transient.assert_called_once()
    # the claim on this host's clock: the database says 30 s have passed since it (st's now is T0 + 30 s)
    until = int(fake.call_args.args[0][-2].removeprefix("--until=@"))
    assert abs(until - (datetime.now(UTC) - timedelta(seconds=31)).timestamp()) < 5


def test_the_claim_is_placed_on_this_hosts_clock_whatever_the_database_clock_says(real_journal, st, mocker):
    """A database clock an hour ahead of this host's: the claim, 30 s ago by the database, is 30 s ago here."""
    rec = real_journal
    run, attempt = pair(1, started=False)
    ahead = datetime.now(UTC) + timedelta(hours=1)
    st.now.return_value = ahead
    attempt = attempt.__class__(**{**attempt.__dict__, "claimed_at": ahead - timedelta(seconds=30)})
    since = rec._claimed_since(attempt)
    assert abs((datetime.now(UTC) - since).total_seconds() - 31) < 5


@pytest.mark.parametrize("failure", [subprocess.TimeoutExpired(["journalctl"], 0.5), completed("", 1)],
                         ids=["timeout", "failed"])
def test_a_started_attempt_whose_unit_is_gone_waits_for_a_readable_journal(real_journal, st, systemd, mocker,
                                                                           events, failure):
    """Settled `lost` at once (0.5.1), a run that succeeded while the daemon was down was retried: it ran
    twice. Its outcome waits for the journal instead."""
    rec = real_journal
    run, attempt = pair(1, max_attempts=3)
    st.open_attempts.return_value = [(run, attempt)]
    mocker.patch.object(journal_mod.subprocess, "run", side_effect=failure if isinstance(failure, Exception)
                        else lambda *a, **k: failure)
    rec.reconcile_pass()
    assert recorded(st) == []
    assert "journal-unreadable" in names(events)
    systemd.start_transient.assert_not_called()


def test_a_started_attempt_whose_unit_is_gone_takes_the_journals_outcome_once_readable(real_journal, st, mocker):
    rec = real_journal
    run, attempt = pair(1, max_attempts=3)
    st.open_attempts.return_value = [(run, attempt)]
    success = {"_PID": "1", "MESSAGE_ID": journal_mod.MSG_UNIT_SUCCESS, "INVOCATION_ID": attempt.invocation_id,
               "__REALTIME_TIMESTAMP": "1714564805000000"}
    mocker.patch.object(journal_mod.subprocess, "run", return_value=completed(json.dumps(success) + "\n"))
    rec.reconcile_pass()
    ((_, outcome, state),) = recorded(st)
    assert (outcome.outcome, state) == ("success", "succeeded")


def test_a_unit_stopped_while_cut_off_is_lost_even_with_an_unreadable_journal(real_journal, st, mocker):
    rec = real_journal
    run, attempt = pair(1)
    rec.cut_off_units.add(attempt.unit_name)
    st.open_attempts.return_value = [(run, attempt)]
    mocker.patch.object(journal_mod.subprocess, "run", side_effect=subprocess.TimeoutExpired(["journalctl"], 0.5))
    rec.reconcile_pass()
    ((_, outcome, _),) = recorded(st)
    assert outcome.outcome == "lost" and "stop_runs_when_cut_off" in outcome.reason


def test_store_now_is_what_the_claim_is_measured_against(real_journal, st, mocker):
    rec = real_journal
    _, attempt = pair(1, started=False)
    rec._claimed_since(attempt)
    st.now.assert_called_once_with(rec.conn)


# -- issue 21: a D-Bus loss mid-batch drops nothing that follows an outcome already committed ------------

@pytest.fixture
def tails(rec, mocker):
    """The reader of output tails, to see which attempts' tails are asked for."""
    rec.output_tails = mocker.Mock(spec=journal_mod.TailReader)
    rec.output_tails.take.return_value = []
    return rec.output_tails


def _ended_in_batch(rec, systemd, count):
    pairs = []
    for n in range(1, count + 1):
        run, attempt = with_env(n)
        rec.env_files.write(attempt.unit_name, run.environment)
        systemd.state.return_value = ended(attempt.unit_name, CLD_EXITED, 0, "success")
        rec.reconcile_one(run, attempt)
        pairs.append((run, attempt))
    return pairs


def test_a_bus_lost_at_the_first_release_still_schedules_every_committed_outcomes_tail(
        rec, st, systemd, tails, environment_directory):
    """Units that ended together: their outcomes committed in one statement, then the bus went away at
    the first release. On 0.5.1 the release's SystemdUnavailable left the loop over the batch, so the
    other attempts' tails were never read (nor were they counted, nor their environment files removed)."""
    st.record_outcomes.return_value = [True, True, True]
    systemd.release.side_effect = SystemdUnavailable("ResetFailedUnit: systemd is not reachable over D-Bus")
    with pytest.raises(SystemdUnavailable), rec.batched_outcomes():  # the daemon reconnects on it
        pairs = _ended_in_batch(rec, systemd, 3)
    assert [c.args for c in tails.add.call_args_list] == [(run.id, attempt.attempt) for run, attempt in pairs]
    assert rec.settled == 3
    assert os.listdir(environment_directory) == []
    # The release stops at the lost bus; the next pass, reconnected, releases the rest (RELEASE of an
    # orphan whose outcome is recorded), and reads their tails again.
    assert systemd.release.call_count == 1


def test_a_bus_lost_mid_batch_in_the_one_by_one_path_records_the_rest_before_releasing(rec, st, systemd, tails):
    """A row the database refused sends the batch one by one; each outcome is recorded before any unit is
    released, so a bus lost at a release costs no outcome its write (the units are the only record of
    them until then, and PID 1 collects a clean one when this connection closes)."""
    st.record_outcomes.side_effect = psycopg.errors.CheckViolation("attempts_accounting_valid")
    st.record_outcome.return_value = True
    systemd.release.side_effect = SystemdUnavailable("gone")
    with pytest.raises(SystemdUnavailable), rec.batched_outcomes():
        pairs = _ended_in_batch(rec, systemd, 3)
    assert [c.args[2] for c in st.record_outcome.call_args_list] == [a for _, a in pairs]
    assert tails.add.call_count == 3 and rec.settled == 3


def test_a_database_lost_mid_batch_keeps_what_follows_the_outcomes_already_written(rec, st, systemd, tails):
    st.record_outcomes.side_effect = psycopg.errors.CheckViolation("attempts_accounting_valid")
    st.record_outcome.side_effect = [True, psycopg.OperationalError("server closed the connection"), True]
    with pytest.raises(psycopg.OperationalError), rec.batched_outcomes():
        (first_run, first), *_ = _ended_in_batch(rec, systemd, 3)
    tails.add.assert_called_once_with(first_run.id, first.attempt)
    systemd.release.assert_called_once_with(first.unit_name, "active")
    assert rec.settled == 1


def test_a_release_that_fails_is_done_by_the_next_pass_and_counts_nothing_again(rec, st, systemd, tails, events):
    """Released exactly once: a refused release leaves the unit (with its recorded outcome) to the next
    pass, which releases it as an orphan; the outcome is neither written again nor counted twice."""
    st.record_outcomes.return_value = [True, True]
    systemd.release.side_effect = [SystemdError("ResetFailedUnit x: Access denied"), None]
    with rec.batched_outcomes():
        pairs = _ended_in_batch(rec, systemd, 2)
    assert systemd.release.call_count == 2 and rec.settled == 2
    assert names(events).count("systemd-error") == 1
    (_, stuck) = pairs[0]
    systemd.release.reset_mock(side_effect=True)
    st.unit_owners.return_value = {stuck.unit_name: store.UnitOwner("me", "success")}
    systemd.list_units.return_value = {stuck.unit_name: EXITED}
    done = rec.reconcile_pass()
    assert [(p.decision.action, p.decision.unit_name) for p in done] == [(Action.RELEASE, stuck.unit_name)]
    systemd.release.assert_called_once_with(stuck.unit_name, "active")
    assert rec.settled == 2 and st.record_outcomes.call_count == 1 and not st.record_outcome.called


def test_an_orphan_released_with_this_hosts_outcome_has_its_tail_read(rec, st, systemd, tails):
    """The outcome committed, then the daemon died (or the bus went) before the release: the next pass
    releases the unit, and reads the tail that was never read (an attempt that has one keeps it)."""
    mine, theirs = unit_name(rid(1), 1), unit_name(rid(2), 3)
    st.unit_owners.return_value = {mine: store.UnitOwner("me", "exit-code"), theirs: store.UnitOwner("web-2", "lost")}
    systemd.list_units.return_value = {mine: UnitBrief("failed", "failed", False), theirs: EXITED}
    rec.reconcile_pass()
    tails.add.assert_called_once_with(rid(1), 1)


@pytest.mark.parametrize("error", [psycopg.OperationalError("server closed the connection"),
                                   store.Fenced("host me is fenced: epoch 7 is over")])
def test_tails_read_but_not_written_for_a_lost_database_are_written_after_the_reconnect(rec, st, error):
    """0.5.1 took the tails out of the reader before the statement: a database lost in it dropped them."""
    rec.output_tails = journal_mod.TailReader(rec.journal, 20, 4096, threaded=False)
    rec.output_tails._done.extend([(rid(1), 1, "last line"), (rid(2), 1, "")])
    st.record_output_tails.side_effect = error
    with pytest.raises(type(error)):
        rec.write_output_tails()
    st.record_output_tails.side_effect = None
    st.record_output_tails.return_value = 2
    assert rec.write_output_tails() == 2
    assert st.record_output_tails.call_args.args[2] == [(rid(1), 1, "last line"), (rid(2), 1, "")]
    assert rec.output_tails.take() == []


def test_tails_a_database_refuses_are_not_kept_for_ever(rec, st):
    """A refusal is no reason to try again: the loop would fail on the same rows at every iteration."""
    rec.output_tails = journal_mod.TailReader(rec.journal, 20, 4096, threaded=False)
    rec.output_tails._done.append((rid(1), 1, "x"))
    st.record_output_tails.side_effect = psycopg.errors.CheckViolation("output_tail")
    with pytest.raises(psycopg.errors.CheckViolation):
        rec.write_output_tails()
    assert rec.output_tails.take() == []


# -- issue 21: nothing in the batch path invents an outcome ------------------------------------------------

def stub(name):
    """What PID 1 answers on the D-Bus path of a unit it has just collected: it loads a new object for the
    name (LoadState not-found), inactive, Result=success, no invocation, no main process (seen in the test
    bed, systemd 252). Systemd.state reads a unit with a GetUnit and then one Get per property: a unit
    collected between them is read as this."""
    return UnitState(name, "inactive", "dead", "success", 0, 0, "", False)


@pytest.mark.parametrize("kind", [{"started": True}, {"started": False}, {"cancelled": True},
                                  {"started": False, "cancelled": True}])
def test_a_stub_is_no_unit(kind):
    from supervisor.reconciler import decide
    run, attempt = pair(1, **kind)
    assert decide(run, attempt, stub(attempt.unit_name)) == decide(run, attempt, None)


def test_a_unit_read_as_a_stub_is_settled_from_the_journal_not_lost(rec, st, systemd):
    """0.5.1 settled it `lost` ("unit ended with result success and no exit status"): its run retried
    and ran twice, though the journal said it had succeeded."""
    run, attempt = pair(1, max_attempts=3)
    systemd.state.return_value = stub(attempt.unit_name)
    rec.journal.outcome.return_value = JOURNAL_SUCCESS
    decision = rec.reconcile_one(run, attempt)
    assert decision.action is Action.GONE
    ((_, outcome, state),) = recorded(st)
    assert (outcome, state) == (JOURNAL_SUCCESS.outcome, "succeeded")
    systemd.release.assert_not_called()  # nothing of ours is loaded: the stub is PID 1's to collect


def test_a_stub_is_not_a_loaded_unit_to_adopt(rec, st, systemd):
    """The journal knows the unit (it ran) and the live check finds a stub (an operator's `systemctl
    status` on the gone unit loads one): 0.5.1 took it for a loaded unit and started it "again", which,
    on a stub, is a second start of the command."""
    run, attempt = pair(1, started=False)
    rec.journal.unit_history.return_value = journal_mod.History.KNOWN
    rec.journal.outcome.return_value = JOURNAL_SUCCESS
    systemd.state.return_value = stub(attempt.unit_name)
    st.open_attempts.return_value = [(run, attempt)]
    (done,) = rec.reconcile_pass()
    assert done.decision.action is Action.GONE
    systemd.start_transient.assert_not_called()


# -- started_units: the units whose changes need no rows while they run (change_needs_rows) -----------

def test_started_units_are_those_marked_started_until_their_attempt_settles(rec, st, mocker):
    mocker.patch.object(store, "mark_started_many")
    (run1, att1), (run2, att2) = pair(1, started=False), pair(2, started=False)
    created: list[Attempt] = []
    rec.start(run1, att1, created)  # in a batch: marked with it, after it
    rec.start(run2, att2)  # alone: marked at once
    assert rec.started_units == {att2.unit_name}
    rec.mark_created(created)
    assert rec.started_units == {att1.unit_name, att2.unit_name}
    rec.settle(run1, att1, Outcome("success", "exit:0", "exited 0"))
    assert rec.started_units == {att2.unit_name}
    assert rec.settled_units == {att1.unit_name}


def test_settled_units_are_forgotten_by_each_pass_and_past_their_cap(rec, st, mocker):
    mocker.patch.object(reconciler_mod, "MAX_SETTLED_UNITS", 2)
    for n in (1, 2, 3):
        run, att = pair(n)
        rec.settle(run, att, Outcome("success", "exit:0", "exited 0"))
    assert rec.settled_units == {pair(3)[1].unit_name}  # two remembered, then forgotten, then the third
    rec.reconcile_pass()
    assert rec.settled_units == set()


def test_a_mark_that_fails_leaves_its_units_to_be_read_in_full(rec, st, mocker):
    mocker.patch.object(store, "mark_started_many", side_effect=store.Fenced("epoch over"))
    run, att = pair(1, started=False)
    created: list[Attempt] = []
    rec.start(run, att, created)
    with pytest.raises(store.Fenced):
        rec.mark_created(created)
    assert rec.started_units == set()


def test_a_pass_counts_the_runs_it_settled_out_of_those_in_flight(rec, st, systemd):
    """A pass that settles ended units leaves in flight only what it did not settle: the daemon claims
    into the slots they freed at once, not a reconcile interval later."""
    running, done, also_done = pair(1), pair(2), pair(3)
    rec.in_flight = 64  # whatever the loop counted before
    st.open_attempts.return_value = [running, done, also_done]
    systemd.list_units.return_value = {running[1].unit_name: RUNNING, done[1].unit_name: EXITED,
                                       also_done[1].unit_name: EXITED}
    systemd.state.side_effect = lambda name, signalled=None: None if name == running[1].unit_name else ended(name)
    rec.reconcile_pass()
    assert len(st.record_outcome.call_args_list) == 2
    assert rec.in_flight == 1


def test_a_pass_keeps_started_units_to_the_open_attempts_recorded_or_marked_as_started(rec, st, systemd):
    running, unstarted, settled_elsewhere, done = pair(1), pair(2, started=False), pair(3), pair(4)
    rec.started_units = {settled_elsewhere[1].unit_name, done[1].unit_name}
    st.open_attempts.return_value = [running, unstarted, done]
    systemd.list_units.return_value = {running[1].unit_name: RUNNING, done[1].unit_name: EXITED}
    systemd.state.side_effect = lambda name, signalled=None: ended(name) if name == done[1].unit_name else None
    rec.reconcile_pass()
    # running: its row says started; unstarted: started by this pass (no unit, the journal knows none);
    # done: settled by this pass, though its row said started when the pass read it
    assert systemd.start_transient.call_args.args[0] == unstarted[1].unit_name
    assert [c.args[2].unit_name for c in st.record_outcome.call_args_list] == [done[1].unit_name]
    assert rec.started_units == {running[1].unit_name, unstarted[1].unit_name}

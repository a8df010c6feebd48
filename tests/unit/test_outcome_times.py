"""Issue 12: an attempt's start and end come from systemd's own clock, and an exit status of 200-243 is
told apart from systemd's setup failure. The store is a mock: what is checked is what reaches it."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from unittest import mock

import pytest

from supervisor import store
from supervisor.config import RunSettings, Settings
from supervisor.journal import (
    MSG_PROCESS_EXIT,
    MSG_SPAWN_FAILED,
    MSG_UNIT_FAILED,
    MSG_UNIT_STARTED,
    Found,
    found_from_records,
    program_ran,
)
from supervisor.model import Attempt, Run
from supervisor.outcomes import CLD_EXITED, CLD_KILLED, Outcome
from supervisor.reconciler import Action, Reconciler, decide
from supervisor.systemd import Systemd, UnitState, from_usec
from supervisor.unitspec import unit_name

RUN_ID = uuid.UUID("00000000-0000-4000-8000-000000000001")
NAME = unit_name(RUN_ID, 1)
INV = "0123456789abcdef0123456789abcdef"
T0 = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
START_US = 1_714_564_800_123_456  # 2024-05-01 12:00:00.123456 UTC
EXIT_US = START_US + 7_250_000
START = datetime(2024, 5, 1, 12, 0, 0, 123456, tzinfo=UTC)
EXIT = datetime(2024, 5, 1, 12, 0, 7, 373456, tzinfo=UTC)


def pair(started=True, cancelled=False):
    run = Run(id=RUN_ID, argv=["/bin/true"], cancel_requested_at=T0 if cancelled else None,
              state="running" if started else "starting")
    attempt = Attempt(run_id=RUN_ID, attempt=1, host_id="me", unit_name=NAME, claimed_at=T0,
                      started_at=T0 if started else None, invocation_id=INV if started else None)
    return run, attempt


def state(active="failed", sub="failed", result="exit-code", code=CLD_EXITED, status=3, start=START_US,
          exit_=EXIT_US, active_enter=START_US + 500):
    return UnitState(NAME, active, sub, result, code, status, INV, False, start, exit_, active_enter)


@pytest.fixture
def st(mocker):
    return mock.Mock(record_outcome=mocker.patch.object(store, "record_outcome", return_value=True),
                     mark_started=mocker.patch.object(store, "mark_started", return_value=None),
                     record_event=mocker.patch.object(store, "record_event", return_value=None))


@pytest.fixture
def rec(mocker):
    systemd = mocker.Mock(spec=Systemd)
    journal = mock.Mock()
    journal.outcome.return_value = None
    journal.exec_evidence.return_value = None
    journal.output_tails.return_value = [None]  # the unthreaded TailReader reads one at a time
    settings = Settings(runs=RunSettings(allowed_executables=("/bin/*",)))
    return Reconciler(settings, store.Fence("me", 1), mock.MagicMock(), systemd, journal=journal, cut_off_units=set())


def times(call: mock._Call) -> dict[str, object]:
    """The times a record_outcome call passed (what else it passed: tests/unit/test_outcome_record.py)."""
    return {key: call.kwargs[key] for key in ("started_at", "ended_at")}


# -- systemd's timestamps ---------------------------------------------------------------------------

@pytest.mark.parametrize(("usec", "expected"), [
    (0, None), (2**64 - 1, None), (START_US, START), (1, datetime(1970, 1, 1, 0, 0, 0, 1, tzinfo=UTC)),
])
def test_from_usec(usec, expected):
    assert from_usec(usec) == expected


def test_unit_state_times():
    assert (state().started_at, state().ended_at) == (START, EXIT)
    assert (state(start=0, exit_=0).started_at, state(start=0, exit_=0).ended_at) == (None, None)


def test_an_ended_unit_settles_with_systemds_start_and_end(rec, st):
    run, attempt = pair()
    rec.apply(run, attempt, decide(run, attempt, state()))
    (call,) = st.record_outcome.call_args_list
    assert call.args[3] == Outcome("exit-code", "exit:3", "exited with status 3")
    assert times(call) == {"started_at": START, "ended_at": EXIT}


def test_a_unit_without_timestamps_leaves_them_to_the_database(rec, st):
    run, attempt = pair()
    rec.apply(run, attempt, decide(run, attempt, state(start=0, exit_=0)))
    assert times(st.record_outcome.call_args) == {"started_at": None, "ended_at": None}


def test_a_cancelled_unit_keeps_its_real_end(rec, st):
    run, attempt = pair(cancelled=True)
    rec.apply(run, attempt, decide(run, attempt, state(result="signal", code=CLD_KILLED, status=15)))
    call = st.record_outcome.call_args
    assert call.args[3].outcome == "cancelled"
    assert times(call) == {"started_at": START, "ended_at": EXIT}


@pytest.mark.parametrize("cancelled", [False, True])
def test_adopting_or_stopping_a_running_unit_records_systemds_start(rec, st, cancelled):
    run, attempt = pair(started=False, cancelled=cancelled)
    running = state(active="active", sub="running", result="success", code=0, status=0, exit_=0)
    decision = decide(run, attempt, running)
    assert decision.action is (Action.STOP if cancelled else Action.ADOPT)
    rec.apply(run, attempt, decision)
    (call,) = st.mark_started.call_args_list
    assert call.kwargs == {"started_at": START}


def test_a_unit_just_created_is_marked_started_at_the_databases_now(rec, st):
    run, attempt = pair(started=False)
    rec.systemd.start_transient.return_value = True
    rec.start(run, attempt)
    assert st.mark_started.call_args.kwargs.get("started_at") is None


def test_a_gone_unit_ends_at_the_journals_exit_record(rec, st):
    run, attempt = pair()
    rec.journal.outcome.return_value = Found(Outcome("exit-code", "exit:3", "exited 3 (from the journal)"), EXIT)
    decision = decide(run, attempt, None)
    assert decision.action is Action.GONE
    rec.apply(run, attempt, decision)
    call = st.record_outcome.call_args
    assert call.args[3].outcome == "exit-code"
    assert times(call) == {"started_at": None, "ended_at": EXIT}


def test_a_gone_unit_the_journal_knows_nothing_of_is_lost_now(rec, st):
    run, attempt = pair()
    rec.apply(run, attempt, decide(run, attempt, None))
    call = st.record_outcome.call_args
    assert call.args[3].outcome == "lost"
    assert times(call) == {"started_at": None, "ended_at": None}


# -- exit statuses 200-243 --------------------------------------------------------------------------

@pytest.mark.parametrize(("active_enter", "evidence", "outcome", "asked"), [
    (START_US + 500, None, "exit-code", False),   # it became active: exec'd, the journal is not asked
    (0, True, "exit-code", True),                 # never active, the journal proves it ran
    (0, False, "start-failed", True),             # the journal shows systemd's spawn failure
    (0, None, "start-failed", True),              # nothing proves anything: as before
])
def test_exit_203_is_told_apart(rec, st, active_enter, evidence, outcome, asked):
    run, attempt = pair()
    rec.journal.exec_evidence.return_value = evidence
    rec.apply(run, attempt, decide(run, attempt, state(status=203, active_enter=active_enter)))
    recorded = st.record_outcome.call_args.args[3]
    assert (recorded.outcome, recorded.exit_status) == (outcome, "exit:203")
    assert ("not proven" in recorded.reason) is (evidence is None and not active_enter)
    if asked:
        rec.journal.exec_evidence.assert_called_once_with(NAME, INV)
    else:
        rec.journal.exec_evidence.assert_not_called()


@pytest.mark.parametrize("status", [0, 3, 199, 244])
def test_the_journal_is_asked_only_about_200_to_243(rec, st, status):
    run, attempt = pair()
    result = "success" if status == 0 else "exit-code"
    rec.apply(run, attempt, decide(run, attempt, state(result=result, status=status, active_enter=0)))
    rec.journal.exec_evidence.assert_not_called()


def test_a_cancelled_203_is_cancelled_without_asking(rec, st):
    run, attempt = pair(cancelled=True)
    rec.apply(run, attempt, decide(run, attempt, state(status=203, active_enter=0)))
    assert st.record_outcome.call_args.args[3].outcome == "cancelled"
    rec.journal.exec_evidence.assert_not_called()


# -- the journal's records --------------------------------------------------------------------------

def exit_record(status=203, code="exited", at=str(EXIT_US)):
    return {"MESSAGE_ID": MSG_PROCESS_EXIT, "EXIT_CODE": code, "EXIT_STATUS": str(status), "__REALTIME_TIMESTAMP": at}


FAILED = {"MESSAGE_ID": MSG_UNIT_FAILED, "UNIT_RESULT": "exit-code"}
STARTED = {"MESSAGE_ID": MSG_UNIT_STARTED}
SPAWN = {"MESSAGE_ID": MSG_SPAWN_FAILED}


@pytest.mark.parametrize(("records", "trust_absence", "expected"), [
    ([SPAWN, exit_record(), FAILED], True, False),
    ([SPAWN, exit_record(), FAILED], False, False),
    ([STARTED, exit_record(), FAILED], False, True),
    ([exit_record(), FAILED], True, True),      # loaded unit, exit record in: the spawn failure would be too
    ([exit_record(), FAILED], False, None),     # after a reboot the absence proves nothing
    ([], True, None),                           # exit record not written yet
])
def test_program_ran(records, trust_absence, expected):
    assert program_ran(records, trust_absence) is expected


@pytest.mark.parametrize(("records", "outcome"), [
    ([SPAWN, exit_record(), FAILED], "start-failed"),
    ([STARTED, exit_record(), FAILED], "exit-code"),
    ([exit_record(), FAILED], "start-failed"),   # after a reboot, unproven: as before
    ([STARTED, exit_record(7), FAILED], "exit-code"),
])
def test_found_from_records_after_a_reboot(records, outcome):
    found = found_from_records(records)
    assert found is not None
    assert found.outcome.outcome == outcome
    assert found.outcome.reason.endswith("(from the journal; the unit was gone)")
    assert found.ended_at == EXIT


def test_found_without_a_timestamp_has_no_end():
    found = found_from_records([STARTED, exit_record(7, at="junk"), FAILED])
    assert found is not None and found.ended_at is None


class FakeJournal:
    """Journal with journalctl replaced by a list of answers, one per call."""

    def __init__(self, answers):
        from supervisor.journal import Journal

        self.journal = Journal(settle_wait=0.5)
        self.answers = list(answers)
        self.calls = 0

        def records(unit_name, invocation_id):
            self.calls += 1
            return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]

        self.journal._records = records  # type: ignore[method-assign]


def test_exec_evidence_waits_for_pid1s_exit_record():
    fake = FakeJournal([[], [], [exit_record(), FAILED]])
    assert fake.journal.exec_evidence(NAME, INV) is True
    assert fake.calls == 3


def test_exec_evidence_gives_up_unproven():
    fake = FakeJournal([[]])
    assert fake.journal.exec_evidence(NAME, INV) is None
    assert fake.calls > 1


def test_exec_evidence_unreadable_journal():
    assert FakeJournal([None]).journal.exec_evidence(NAME, INV) is None

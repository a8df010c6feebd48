"""Issue 21, suspected: "a journal that cannot be read (rotated, slow, corrupt) makes the reconciler start
an attempt a second time". Proven on 0.5.1: an attempt claimed here and never marked started (the daemon
killed between StartTransientUnit and the mark), whose unit ended cleanly and was collected, was started
again whenever journalctl failed, timed out, printed garbage, or the records had been rotated or vacuumed
away, since "nothing in the journal" and "no journal" were one answer. Its run then ran twice.

Here: the pure decision (decide_unstarted) over every value of its new input, and the journal's answer
(Journal.unit_history) with journalctl faked at subprocess.run. The Reconciler with a real Journal whose
journalctl fails in each way, which is where 0.5.1 started the unit, is in test_reconciler_acting.py.
"""

from __future__ import annotations

import itertools
import json
import subprocess
from datetime import UTC, datetime, timedelta

import pytest

from supervisor import journal
from supervisor.journal import MSG_UNIT_STARTED, History, Journal
from supervisor.reconciler import UNPROVEN_LOST, Action, decide, decide_unstarted
from tests.unit.test_reconciler_acting import pair

UNIT_FIELDS = {"_PID": "1", "MESSAGE_ID": MSG_UNIT_STARTED, "__REALTIME_TIMESTAMP": "1714564800000000"}
NOW = datetime(2024, 5, 1, 12, 10, tzinfo=UTC)


def completed(stdout: str = "", returncode: int = 0) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess([], returncode, stdout=stdout, stderr="")


def old_record(at: datetime) -> str:
    return json.dumps({"_PID": "1", "__REALTIME_TIMESTAMP": str(int(at.timestamp() * 1_000_000))}) + "\n"


# -- the pure decision: every value of what the journal says, the unit loaded now or not ----------------

@pytest.mark.parametrize(("history", "loaded_now"), list(itertools.product(History, (False, True))))
def test_an_unstarted_attempt_is_started_only_on_proof_that_its_unit_never_ran(history, loaded_now):
    run, attempt = pair(1, started=False)
    assert decide(run, attempt, None).action is Action.START  # the only row decide_unstarted is asked about
    decision = decide_unstarted(run, attempt, history, loaded_now)
    expected = {
        History.UNKNOWN: Action.START,  # the journal reaches back to the claim and knows no such unit
        History.KNOWN: Action.GONE,  # PID 1 logged it: started before, by a daemon that died
        History.INCOMPLETE: Action.GONE,  # rotated, vacuumed, or an older boot's: may have run
        History.UNREADABLE: Action.WAIT,  # nothing known either way: a later pass decides
    }[history]
    if loaded_now:
        expected = Action.START  # started "again" is adoption of the unit that is there
    assert decision.action is expected
    assert decision.unit_name == attempt.unit_name
    if decision.action is Action.GONE:
        # never started again; the journal's outcome if it has one (Reconciler.apply), else lost
        assert decision.outcome.outcome == "lost"
    if history is History.INCOMPLETE and not loaded_now:
        assert decision.outcome == UNPROVEN_LOST and "not started again" in decision.outcome.reason


def test_a_start_needs_the_journal_to_reach_back_or_the_unit_to_be_there():
    run, attempt = pair(1, started=False)
    starts = {(h, loaded) for h, loaded in itertools.product(History, (False, True))
              if decide_unstarted(run, attempt, h, loaded).action is Action.START}
    assert starts == {(History.UNKNOWN, False), *((h, True) for h in History)}


# -- Journal.unit_history: journalctl at its boundary -------------------------------------------------------

@pytest.fixture
def jctl(mocker):
    fake = mocker.patch.object(journal.subprocess, "run")
    fake.return_value = completed()
    mocker.patch.object(journal, "_boot_started", return_value=(NOW - timedelta(days=1)).timestamp())
    return fake


SINCE = NOW - timedelta(minutes=5)


def test_a_unit_pid1_logged_about_is_known(jctl):
    jctl.return_value = completed(json.dumps(UNIT_FIELDS) + "\n")
    assert Journal().unit_history("u.service", SINCE) is History.KNOWN
    assert jctl.call_count == 1  # no need to ask how far back the journal goes


def test_nothing_about_the_unit_in_a_journal_that_reaches_back_is_unknown(jctl):
    jctl.side_effect = [completed(), completed(old_record(SINCE - timedelta(hours=2)))]
    assert Journal().unit_history("u.service", SINCE) is History.UNKNOWN
    cmd = jctl.call_args.args[0]
    # --reverse: the newest record at or before --until (--lines=1 alone counts from the journal's tail)
    assert cmd == ["journalctl", "--no-pager", "-q", "-o", "json", "--reverse", "--lines=1", "--output-fields=_PID",
                   f"--until=@{int(SINCE.timestamp())}", "_PID=1"]


def test_nothing_about_the_unit_in_a_rotated_or_vacuumed_journal_is_incomplete(jctl):
    # `journalctl --rotate --vacuum-files=1`: the oldest record PID 1 has left is newer than the claim
    jctl.side_effect = [completed(), completed()]
    assert Journal().unit_history("u.service", SINCE) is History.INCOMPLETE


def test_a_record_newer_than_asked_for_proves_nothing(jctl):
    jctl.side_effect = [completed(), completed(old_record(SINCE + timedelta(seconds=3)))]
    assert Journal().unit_history("u.service", SINCE) is History.INCOMPLETE


def test_a_claim_older_than_this_boot_is_incomplete_whatever_the_journal_holds(jctl, mocker):
    # A power cut may keep a later journal page and lose an earlier one: no absence proves anything there.
    mocker.patch.object(journal, "_boot_started", return_value=(SINCE + timedelta(seconds=1)).timestamp())
    assert Journal().unit_history("u.service", SINCE) is History.INCOMPLETE
    assert jctl.call_count == 1


def test_an_unknown_claim_time_is_incomplete(jctl):
    assert Journal().unit_history("u.service", None) is History.INCOMPLETE


@pytest.mark.parametrize("failure", [
    subprocess.TimeoutExpired(["journalctl"], 10.0),  # slow: a journal on a hung disk, or huge
    OSError(5, "Input/output error"),
    completed("", 1),  # "No journal files were found.", a corrupt file journalctl gives up on
    completed("\x00\x17garbage\n"),
    completed(json.dumps(UNIT_FIELDS)[:20] + "\n"),  # cut short
], ids=["timeout", "oserror", "failed", "garbage", "cut-short"])
@pytest.mark.parametrize("which", ["records", "reach"])
def test_a_journalctl_that_fails_is_unreadable_never_unknown(jctl, failure, which):
    jctl.side_effect = [failure] if which == "records" else [completed(), failure]
    assert Journal().unit_history("u.service", SINCE) is History.UNREADABLE


def test_after_a_timeout_the_journal_is_not_asked_again_for_a_while(jctl, mocker):
    """A pass over many attempts whose journal hangs pays one timeout, not one each: the loop that
    waits for it also renews the heartbeat, and peers declare a host dead after host_dead_after."""
    clock = mocker.patch.object(journal.time, "monotonic", return_value=1000.0)
    jctl.side_effect = subprocess.TimeoutExpired(["journalctl"], 10.0)
    reader = Journal()
    assert reader.unit_history("a.service", SINCE) is History.UNREADABLE
    assert reader.unit_history("b.service", SINCE) is History.UNREADABLE
    with pytest.raises(journal.Unreadable):
        reader.outcome("c.service", None)
    assert jctl.call_count == 1
    clock.return_value = 1000.0 + Journal.QUIET_AFTER_TIMEOUT
    jctl.side_effect = None
    jctl.return_value = completed(json.dumps(UNIT_FIELDS) + "\n")
    assert reader.unit_history("a.service", SINCE) is History.KNOWN


def test_a_journalctl_that_fails_at_once_is_asked_again_next_time(jctl):
    jctl.return_value = completed("", 1)
    reader = Journal()
    assert reader.unit_history("a.service", SINCE) is History.UNREADABLE
    assert reader.unit_history("b.service", SINCE) is History.UNREADABLE
    assert jctl.call_count == 2

"""Failure rules (issue 25, item 3; sql/migrations/027_failure_rules.sql): supervisor.outcomes.failure_verdict,
the twin of unitvisor.failure_verdict, over its whole decision table.

The table is every combination of the things the decision reads, each over the values that make a
difference (and one that does not): the outcome (all eleven), the exit status, retry_on, fail_on,
count_lost, a cancel, the attempt number around max_attempts and the lost count around
max_lost_attempts. Each case is checked against `expected` below, which states the rules in the order
docs/sql-api.md gives them, written from the rules and not from the code; and some rows are spelt out
by hand, as a reader would check them.
"""

from __future__ import annotations

import itertools
import signal
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from supervisor.model import Run
from supervisor.outcomes import OUTCOMES, SIGNAL_NAMES, Verdict, failure_code, failure_verdict, retry_delay

RUN_ID = uuid.UUID("12345678-9abc-4def-8123-456789abcdef")
CANCELLED_AT = datetime(2026, 12, 1, tzinfo=UTC)
MAX_ATTEMPTS = 2
MAX_LOST = 2

STATUSES = (None, "exit:0", "exit:3", "exit:75", "signal:TERM", "signal:KILL")
RETRY_ON = (None, (), ("exit-code",), ("lost",), ("exit:75",), ("signal:TERM",), ("exit:75", "lost"),
            ("exit:3",))
FAIL_ON = (None, (), ("exit:3",), ("signal:TERM",), ("exit:75",))
ATTEMPTS = (1, 2, 3, 4)
LOSTS = (0, 1, 2, 3)


def run(retry_on, fail_on, count_lost, cancelled) -> Run:
    return Run(id=RUN_ID, argv=["/bin/true"], max_attempts=MAX_ATTEMPTS, max_lost_attempts=MAX_LOST,
               retry_on=None if retry_on is None else list(retry_on),
               fail_on=None if fail_on is None else list(fail_on), count_lost=count_lost,
               cancel_requested_at=CANCELLED_AT if cancelled else None)


def expected(outcome, status, retry_on, fail_on, count_lost, cancelled, attempt, lost) -> tuple[bool, str | None]:
    """The rules, in their order (docs/sql-api.md, Failure rules): the first that applies decides."""
    failure = outcome in {"exit-code", "signal", "core-dump", "timeout", "oom-kill", "watchdog", "start-failed",
                          "lost"}
    # What exit:N and signal:NAME match: the main process's own exit, a kill by that signal.
    code = (status if (outcome == "exit-code" and status and status.startswith("exit:"))
            or (outcome in ("signal", "core-dump") and status and status.startswith("signal:")) else None)
    if cancelled or not failure:
        return False, None
    if code and fail_on and code in fail_on:
        return False, "fail_on"
    if retry_on is not None and outcome not in retry_on and code not in retry_on:
        return False, None
    if outcome == "lost" and not count_lost:
        return (False, "max_lost_attempts") if lost >= MAX_LOST else (True, "not counted")
    counted = attempt - (0 if count_lost else lost)
    return counted < MAX_ATTEMPTS, None


POLICIES = list(itertools.product(RETRY_ON, FAIL_ON, (False, True), (False, True)))
# A lost attempt is one of the run's lost ones: lost counts it, so lost 0 with outcome lost is no case.
ENDINGS = [(outcome, status, attempt, lost)
           for outcome, status, attempt, lost in itertools.product(OUTCOMES, STATUSES, ATTEMPTS, LOSTS)
           if not (outcome == "lost" and lost == 0)]


def test_the_whole_table() -> None:
    wrong = []
    for retry_on, fail_on, count_lost, cancelled in POLICIES:
        policy = run(retry_on, fail_on, count_lost, cancelled)
        for outcome, status, attempt, lost in ENDINGS:
            got = failure_verdict(policy, attempt, lost, outcome, status)
            retry, why = expected(outcome, status, retry_on, fail_on, count_lost, cancelled, attempt, lost)
            if got.retry != retry or (why is None) != (got.why is None) or (why and why not in got.why):
                wrong.append((outcome, status, retry_on, fail_on, count_lost, cancelled, attempt, lost, got))
    assert not wrong, f"{len(wrong)} of {len(POLICIES) * len(ENDINGS)} cases differ, the first: {wrong[:5]}"
    assert len(POLICIES) * len(ENDINGS) > 100000


@pytest.mark.parametrize(("outcome", "status", "retry_on", "fail_on", "count_lost", "attempt", "lost", "verdict"), [
    # exit:75 retries an exit 75 that retry_on's kinds would not; not an exit 3, not a kill.
    ("exit-code", "exit:75", ["exit:75"], None, False, 1, 0, Verdict(True)),
    ("exit-code", "exit:3", ["exit:75"], None, False, 1, 0, Verdict(False)),
    ("signal", "signal:TERM", ["exit:75"], None, False, 1, 0, Verdict(False)),
    # ... but within max_attempts: the attempt that uses them up is not retried.
    ("exit-code", "exit:75", ["exit:75"], None, False, 2, 0, Verdict(False)),
    # signal:TERM matches a kill by TERM, not a timeout (whose stop was a TERM too) nor an exit.
    ("signal", "signal:TERM", ["signal:TERM"], None, False, 1, 0, Verdict(True)),
    ("core-dump", "signal:TERM", ["signal:TERM"], None, False, 1, 0, Verdict(True)),
    ("timeout", "signal:TERM", ["signal:TERM"], None, False, 1, 0, Verdict(False)),
    # fail_on wins over retry_on's kinds (the default retries every failure), with attempts left.
    ("exit-code", "exit:3", None, ["exit:3"], False, 1, 0, Verdict(False, "no retry: fail_on names exit:3")),
    ("exit-code", "exit:3", ["exit-code"], ["exit:3"], False, 1, 0, Verdict(False, "no retry: fail_on names exit:3")),
    ("exit-code", "exit:4", None, ["exit:3"], False, 1, 0, Verdict(True)),
    ("signal", "signal:TERM", None, ["signal:TERM"], False, 1, 0,
     Verdict(False, "no retry: fail_on names signal:TERM")),
    # A lost attempt does not count: retried past max_attempts, until max_lost_attempts lost ones.
    ("lost", None, None, None, False, 2, 1,
     Verdict(True, "lost with its host, not counted against max_attempts (1 of max_lost_attempts 2)")),
    ("lost", None, None, None, False, 3, 2,
     Verdict(False, "no retry: max_lost_attempts reached (2 attempts lost with their host)")),
    # ... and the attempts after it have max_attempts to themselves: attempt 3 after two lost is the first.
    ("exit-code", "exit:1", None, None, False, 3, 2, Verdict(True)),
    ("exit-code", "exit:1", None, None, False, 4, 2, Verdict(False)),
    # count_lost: a lost attempt is one of max_attempts, as before 027, and the cap is not needed.
    ("lost", None, None, None, True, 1, 1, Verdict(True)),
    ("lost", None, None, None, True, 2, 2, Verdict(False)),
    ("exit-code", "exit:1", None, None, True, 2, 1, Verdict(False)),
    # retry_on without lost: a lost attempt ends the run (at most once), counted or not.
    ("lost", None, ["exit-code"], None, False, 1, 1, Verdict(False)),
])
def test_rows_by_hand(outcome, status, retry_on, fail_on, count_lost, attempt, lost, verdict) -> None:
    r = Run(id=RUN_ID, argv=["/bin/true"], max_attempts=MAX_ATTEMPTS, max_lost_attempts=MAX_LOST,
            retry_on=retry_on, fail_on=fail_on, count_lost=count_lost)
    assert failure_verdict(r, attempt, lost, outcome, status) == verdict


def test_a_cancel_wins_over_everything() -> None:
    r = run(("lost",), None, False, True)
    assert failure_verdict(r, 1, 1, "lost", None) == Verdict(False)


def test_failure_code() -> None:
    assert failure_code("exit-code", "exit:75") == "exit:75"
    assert failure_code("start-failed", "exit:203") is None  # systemd's, not the command's
    assert failure_code("signal", "signal:KILL") == "signal:KILL"
    assert failure_code("oom-kill", "signal:KILL") is None
    assert failure_code("exit-code", None) is None


def test_retry_delay_counts_the_lost_attempts_read_with_the_run() -> None:
    """retry_delay adds the attempt being settled to the run's lost attempts read before it."""
    r = Run(id=RUN_ID, argv=["/bin/true"], max_attempts=1, max_lost_attempts=3, lost_attempts=1)
    assert retry_delay(r, 2, "lost", lambda: 1.0) == timedelta(seconds=20)  # 2 lost of 3
    r = Run(id=RUN_ID, argv=["/bin/true"], max_attempts=1, max_lost_attempts=3, lost_attempts=2)
    assert retry_delay(r, 3, "lost", lambda: 1.0) is None  # the third
    r = Run(id=RUN_ID, argv=["/bin/true"], max_attempts=2, retry_on=["exit:75"])
    assert retry_delay(r, 1, "exit-code", lambda: 1.0, "exit:75") == timedelta(seconds=10)
    assert retry_delay(r, 1, "exit-code", lambda: 1.0, "exit:74") is None


def test_signal_names_are_those_signal_name_gives() -> None:
    """The names retry_on and fail_on accept (and unitvisor.failure_rules_problem lists) are exactly
    those the attempts record (outcomes.signal_name), so that each can match."""
    assert set(SIGNAL_NAMES) == {s.name.removeprefix("SIG") for s in signal.Signals}

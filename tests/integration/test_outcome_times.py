
"""Issue 12: the start and end that mark_started and record_outcome store are systemd's own times when
given, the database's now() otherwise, and a recorded start is never replaced by a later-noticed one."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from supervisor import store, unitspec
from supervisor.model import Attempt
from supervisor.outcomes import Outcome
from tests.integration.conftest import fence_of, register

# Each test runs twice: as the superuser, and with every host call of the store made as a login role
# bound to its host id (tests/integration/conftest.py, as_bound_roles).
pytestmark = pytest.mark.usefixtures("as_bound_roles")

FAILED = Outcome("exit-code", "exit:3", "exited with status 3")
REAL_START = datetime(2024, 5, 1, 12, 0, 0, 123456, tzinfo=UTC)
REAL_END = datetime(2024, 5, 1, 12, 0, 7, 373456, tzinfo=UTC)


def claimed(conn: psycopg.Connection) -> tuple[uuid.UUID, Attempt]:
    run_id = store.submit_run(conn, argv=["/bin/true"])
    [(_, attempt)] = store.claim(conn, register(conn, "h1"), 1, unitspec.UNIT_NAME_FORMAT)
    # Claimed before systemd's times below: a time read by a host is kept within its attempt's claim and
    # the moment it is recorded (sql/013_fleet_promises.sql).
    conn.execute("UPDATE unitvisor.attempts SET claimed_at = %s WHERE run_id = %s",
                 (REAL_START - timedelta(hours=1), run_id))
    return run_id, attempt


def times(conn: psycopg.Connection, run_id: uuid.UUID) -> tuple[datetime | None, datetime | None]:
    [row] = store.get_attempts(conn, run_id)
    return row.started_at, row.ended_at


def db_now(conn: psycopg.Connection) -> datetime:
    return store.now(conn)


def test_mark_started_stores_systemds_start(conn: psycopg.Connection) -> None:
    run_id, attempt = claimed(conn)
    store.mark_started(conn, fence_of(conn, "h1"), attempt, "inv", started_at=REAL_START)
    assert times(conn, run_id) == (REAL_START, None)
    assert store.get_run(conn, run_id).state == "running"


def test_a_recorded_start_is_never_replaced(conn: psycopg.Connection) -> None:
    run_id, attempt = claimed(conn)
    fence = fence_of(conn, "h1")
    store.mark_started(conn, fence, attempt, "inv")  # the daemon's now(), at creation
    first, _ = times(conn, run_id)
    assert first is not None and abs(first - db_now(conn)) < timedelta(seconds=5)
    store.mark_started(conn, fence, attempt, "inv", started_at=REAL_START)  # adopted later
    assert times(conn, run_id)[0] == first
    assert store.record_outcome(conn, fence, attempt, FAILED, "failed", None, "inv",
                                started_at=REAL_START, ended_at=first + timedelta(microseconds=1))
    assert times(conn, run_id) == (first, first + timedelta(microseconds=1))


def test_an_end_read_before_the_recorded_start_is_the_start(conn: psycopg.Connection) -> None:
    # Two clocks (the database's start, a host's end) never make a negative duration.
    run_id, attempt = claimed(conn)
    fence = fence_of(conn, "h1")
    store.mark_started(conn, fence, attempt, "inv")
    first, _ = times(conn, run_id)
    assert store.record_outcome(conn, fence, attempt, FAILED, "failed", None, "inv", ended_at=REAL_END)
    assert times(conn, run_id) == (first, first)


def test_times_read_outside_the_attempts_life_are_kept_within_it(conn: psycopg.Connection) -> None:
    run_id, attempt = claimed(conn)
    fence = fence_of(conn, "h1")
    claimed_at = REAL_START - timedelta(hours=1)
    store.mark_started(conn, fence, attempt, "inv", started_at=claimed_at - timedelta(days=1))
    assert times(conn, run_id)[0] == claimed_at  # no unit starts before its claim
    before = db_now(conn)
    assert store.record_outcome(conn, fence, attempt, FAILED, "failed", None, "inv",
                                ended_at=before + timedelta(days=1))
    assert before <= times(conn, run_id)[1] <= db_now(conn)  # nor ends after it is recorded


def test_record_outcome_stores_systemds_start_and_end(conn: psycopg.Connection) -> None:
    # A unit seen only once it had ended (the daemon was down all its life).
    run_id, attempt = claimed(conn)
    assert store.record_outcome(conn, fence_of(conn, "h1"), attempt, FAILED, "failed", None, "inv",
                                started_at=REAL_START, ended_at=REAL_END)
    assert times(conn, run_id) == (REAL_START, REAL_END)


def test_record_outcome_without_times_uses_now(conn: psycopg.Connection) -> None:
    run_id, attempt = claimed(conn)
    assert store.record_outcome(conn, fence_of(conn, "h1"), attempt, FAILED, "failed", None, "inv")
    started, ended = times(conn, run_id)
    now = db_now(conn)
    assert started is not None and ended is not None
    assert abs(ended - now) < timedelta(seconds=5) and abs(started - now) < timedelta(seconds=5)


def test_record_outcome_without_unit_leaves_start_empty(conn: psycopg.Connection) -> None:
    # Never started (refused, cancelled before its unit): no start, and the end is now().
    run_id, attempt = claimed(conn)
    assert store.record_outcome(conn, fence_of(conn, "h1"), attempt, Outcome("refused", None, "no"), "failed")
    started, ended = times(conn, run_id)
    assert started is None and ended is not None


def test_a_journal_end_without_start_keeps_the_recorded_start(conn: psycopg.Connection) -> None:
    run_id, attempt = claimed(conn)
    fence = fence_of(conn, "h1")
    store.mark_started(conn, fence, attempt, "inv", started_at=REAL_START)
    assert store.record_outcome(conn, fence, attempt, FAILED, "failed", ended_at=REAL_END)
    assert times(conn, run_id) == (REAL_START, REAL_END)


def test_a_second_outcome_changes_no_time(conn: psycopg.Connection) -> None:
    run_id, attempt = claimed(conn)
    fence = fence_of(conn, "h1")
    assert store.record_outcome(conn, fence, attempt, FAILED, "failed", None, "inv",
                                started_at=REAL_START, ended_at=REAL_END)
    later = REAL_END + timedelta(hours=1)
    assert not store.record_outcome(conn, fence, attempt, FAILED, "failed", None, "inv",
                                    started_at=later, ended_at=later)
    store.mark_started(conn, fence, attempt, "inv", started_at=later)
    assert times(conn, run_id) == (REAL_START, REAL_END)

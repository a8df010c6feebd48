"""The SQL API a control plane calls (sql/005_sql_api.sql): run_status, and the completion signal."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import timedelta

import psycopg
import pytest

from supervisor import store
from supervisor.outcomes import Outcome
from tests.integration.conftest import wait_notifies
from tests.integration.test_outcome_and_cancel import (
    CANCELLED,
    FAILED,
    SUCCEEDED,
    claim_one,
    mark_started,
    record_outcome,
    started,
    submit,
)

# Each test runs twice: as the superuser, and with the store's calls made as bound host roles and as a
# submitter (tests/integration/conftest.py, as_bound_roles).
pytestmark = pytest.mark.usefixtures("as_bound_roles")


# -- run_status ---------------------------------------------------------------------------------------


def test_run_status_of_a_queued_run_has_no_attempt(conn: psycopg.Connection) -> None:
    run_id = submit(conn)
    status = store.run_status(conn, run_id)
    assert status is not None
    assert (status.id, status.state, status.attempts, status.attempt, status.host_id, status.outcome) == (
        run_id, "queued", 0, None, None, None)
    assert status.finished_at is None and status.created_at is not None
    assert status.cancel_requested is False and status.wait_reason is None


def test_run_status_of_an_unknown_run_is_no_row(conn: psycopg.Connection) -> None:
    assert store.run_status(conn, uuid.uuid4()) is None


def test_run_status_sees_a_run_submitted_in_the_same_transaction(conn: psycopg.Connection) -> None:
    with conn.transaction():
        run_id = submit(conn)
        assert store.run_status(conn, run_id).state == "queued"
        raise psycopg.Rollback()
    assert store.run_status(conn, run_id) is None


def test_run_status_reports_the_latest_attempt(conn: psycopg.Connection) -> None:
    run_id, first = started(conn, max_attempts=2)
    assert record_outcome(conn, first, FAILED, "queued", timedelta(0))
    second = claim_one(conn, "h1")
    mark_started(conn, second, "inv-2")
    status = store.run_status(conn, run_id)
    assert (status.state, status.attempts, status.attempt, status.host_id, status.outcome) == (
        "running", 2, 2, "h1", None)
    assert record_outcome(conn, second, SUCCEEDED, "succeeded")
    status = store.run_status(conn, run_id)
    assert (status.state, status.attempts, status.attempt, status.outcome, status.exit_status, status.reason) == (
        "succeeded", 2, 2, "success", "exit:0", "exited 0")
    assert status.finished_at is not None


def test_run_status_shows_a_cancel_requested(conn: psycopg.Connection) -> None:
    run_id, attempt = started(conn)
    store.cancel_run(conn, run_id)
    status = store.run_status(conn, run_id)
    assert (status.state, status.cancel_requested) == ("running", True)
    assert record_outcome(conn, attempt, CANCELLED, "cancelled")
    assert store.run_status(conn, run_id).state == "cancelled"


def test_run_status_says_why_a_queued_run_waits(conn: psycopg.Connection) -> None:
    run_id = submit(conn)
    conn.execute("INSERT INTO unitvisor.run_waits (run_id, reason) VALUES (%s, 'no live host')", (run_id,))
    assert store.run_status(conn, run_id).wait_reason == "no live host"


# -- the completion signal ----------------------------------------------------------------------------


@pytest.fixture
def finished_listener(dsn: str) -> Iterator[psycopg.Connection]:
    with store.connect(dsn) as connection:
        store.listen(connection, "unitvisor_run_finished")
        yield connection


def finished(listener: psycopg.Connection, timeout: float = 1.0) -> list[dict]:
    """Every unitvisor_run_finished payload heard within timeout, decoded."""
    notes = wait_notifies(listener, timeout=timeout, count=100)
    assert {n.channel for n in notes} <= {"unitvisor_run_finished"}
    return [json.loads(n.payload) for n in notes]


@pytest.mark.parametrize(("outcome", "state"), [(SUCCEEDED, "succeeded"), (FAILED, "failed"),
                                                (CANCELLED, "cancelled")])
def test_a_finished_run_notifies_once_and_intermediate_states_never(
        conn: psycopg.Connection, finished_listener: psycopg.Connection, outcome: Outcome, state: str) -> None:
    run_id, attempt = started(conn)  # queued, starting, running: nothing
    assert finished(finished_listener, timeout=0.3) == []
    assert record_outcome(conn, attempt, outcome, state)
    assert finished(finished_listener) == [{"run_id": str(run_id), "state": state}]


def test_a_retry_is_not_a_finish_and_the_last_attempt_is(conn: psycopg.Connection,
                                                        finished_listener: psycopg.Connection) -> None:
    run_id, first = started(conn, max_attempts=2)
    assert record_outcome(conn, first, FAILED, "queued", timedelta(0))  # back to queued
    second = claim_one(conn, "h1")
    mark_started(conn, second, "inv-2")
    assert finished(finished_listener, timeout=0.3) == []
    assert record_outcome(conn, second, FAILED, "failed")
    assert finished(finished_listener) == [{"run_id": str(run_id), "state": "failed"}]


def test_cancelling_a_queued_run_notifies(conn: psycopg.Connection, finished_listener: psycopg.Connection) -> None:
    run_id = submit(conn)
    store.cancel_run(conn, run_id)
    assert finished(finished_listener) == [{"run_id": str(run_id), "state": "cancelled"}]
    # A cancel of a finished run changes nothing, and says nothing again.
    store.cancel_run(conn, run_id)
    assert finished(finished_listener, timeout=0.3) == []


def test_a_resumed_run_notifies_again_when_it_finishes_again(conn: psycopg.Connection,
                                                            finished_listener: psycopg.Connection) -> None:
    run_id = submit(conn)
    store.cancel_run(conn, run_id)
    store.resume_run(conn, run_id)
    store.cancel_run(conn, run_id)
    assert finished(finished_listener) == [{"run_id": str(run_id), "state": "cancelled"}] * 2


def test_the_notification_is_sent_at_commit_and_not_on_rollback(conn: psycopg.Connection,
                                                               finished_listener: psycopg.Connection) -> None:
    kept, dropped = submit(conn), submit(conn)
    with conn.transaction():
        store.cancel_run(conn, kept)
        # Inside the transaction the listener hears nothing: the run is not cancelled for anyone else yet.
        assert finished(finished_listener, timeout=0.3) == []
    assert finished(finished_listener) == [{"run_id": str(kept), "state": "cancelled"}]
    with conn.transaction():
        store.cancel_run(conn, dropped)
        raise psycopg.Rollback()
    assert finished(finished_listener, timeout=0.3) == []


def test_a_resume_inside_a_rolled_back_transaction_never_happened(conn: psycopg.Connection) -> None:
    run_id = submit(conn)
    store.cancel_run(conn, run_id)
    with conn.transaction():
        assert store.resume_run(conn, run_id) == store.Transition("queued", True)
        assert store.run_status(conn, run_id).state == "queued"  # the caller's own transaction sees it
        raise psycopg.Rollback()
    assert store.run_status(conn, run_id).state == "cancelled"
    assert store.resume_run(conn, run_id) == store.Transition("queued", True)  # and it can still be resumed


def test_one_notification_per_run_of_a_batch(conn: psycopg.Connection, finished_listener: psycopg.Connection) -> None:
    ids = {submit(conn) for _ in range(5)}
    with conn.transaction():
        for run_id in ids:
            store.cancel_run(conn, run_id)
    heard = finished(finished_listener)
    assert sorted(n["run_id"] for n in heard) == sorted(map(str, ids))
    assert {n["state"] for n in heard} == {"cancelled"}


# -- runs_with_labels ---------------------------------------------------------------------------------


def test_runs_with_labels_returns_the_runs_carrying_every_given_pair(conn: psycopg.Connection) -> None:
    both = submit(conn, labels={"team": "infra", "job": "backup"})
    team_only = submit(conn, labels={"team": "infra", "job": "restore"})
    other = submit(conn, labels={"team": "web"})
    submit(conn)  # no labels
    assert [s.id for s in store.runs_with_labels(conn, {"team": "infra", "job": "backup"})] == [both]
    assert {s.id for s in store.runs_with_labels(conn, {"team": "infra"})} == {both, team_only}
    assert store.runs_with_labels(conn, {"team": "nobody"}) == []
    assert len(store.runs_with_labels(conn, {})) == 4  # no condition: every run
    status = store.runs_with_labels(conn, {"team": "web"})[0]
    assert status == store.run_status(conn, other)  # the same columns as run_status
    assert status.labels == {"team": "web"} and status.state == "queued"


def test_runs_with_labels_is_newest_first_and_bounded(conn: psycopg.Connection) -> None:
    ids = [submit(conn, labels={"batch": "7"}) for _ in range(3)]
    conn.execute("UPDATE unitvisor.runs SET created_at = now() - make_interval(secs => %s) WHERE id = %s",
                  (10, ids[0]))
    found = [s.id for s in store.runs_with_labels(conn, {"batch": "7"}, max_rows=2)]
    assert len(found) == 2 and ids[0] not in found


def test_max_rows_null_is_no_bound_and_a_negative_one_is_refused_by_name(conn: psycopg.Connection) -> None:
    for _ in range(3):
        submit(conn, labels={"batch": "8"})
    unbounded = conn.execute("SELECT count(*) FROM unitvisor.runs_with_labels('{\"batch\": \"8\"}', NULL)")
    assert unbounded.fetchone() == (3,)
    assert conn.execute("SELECT count(*) FROM unitvisor.runs_with_labels('{}', 0)").fetchone() == (0,)
    with pytest.raises(psycopg.Error) as refused:
        conn.execute("SELECT count(*) FROM unitvisor.runs_with_labels('{}', max_rows => -1)")
    assert (refused.value.sqlstate, refused.value.diag.message_primary) == (
        "22023", "max_rows: -1 is out of range (0 or more; NULL for no bound)")


def test_a_filter_that_is_not_an_object_matches_nothing(conn: psycopg.Connection) -> None:
    submit(conn, labels={"a": "b"})
    assert conn.execute("SELECT count(*) FROM unitvisor.runs_with_labels('[\"a\"]'::jsonb)").fetchone() == (0,)
    assert conn.execute("SELECT count(*) FROM unitvisor.runs_with_labels(NULL)").fetchone() == (0,)


def test_runs_with_labels_uses_the_gin_index(conn: psycopg.Connection) -> None:
    conn.execute("SET enable_seqscan = off")
    plan = "\n".join(row[0] for row in conn.execute(
        "EXPLAIN SELECT r.id FROM unitvisor.runs r WHERE r.labels @> '{\"a\": \"b\"}'::jsonb"))
    conn.execute("RESET enable_seqscan")
    assert "runs_labels_idx" in plan

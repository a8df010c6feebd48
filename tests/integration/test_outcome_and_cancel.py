"""mark_started, record_outcome, cancel_run, notifications, open_attempts and host rows."""

from __future__ import annotations

import select
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from supervisor import globs, store, unitspec
from supervisor.model import Accounting, Attempt
from supervisor.outcomes import Outcome
from tests.integration.conftest import fence_of, host_profile, look_again, register, silence, wait_notifies

# Each test runs twice: as the superuser, and with every host call of the store made as a login role
# bound to its host id (tests/integration/conftest.py, as_bound_roles).
pytestmark = pytest.mark.usefixtures("as_bound_roles")

SUCCEEDED = Outcome("success", "exit:0", "exited 0")
FAILED = Outcome("exit-code", "exit:3", "exited with status 3")
CANCELLED = Outcome("cancelled", "signal:TERM", "cancelled by request")


def submit(conn: psycopg.Connection, **values: object) -> uuid.UUID:
    values.setdefault("argv", ["/bin/true"])
    return store.submit_run(conn, **values)


def claim(conn: psycopg.Connection, host: str = "h1", batch: int = 10, max_runs: int = 1000) -> list:
    """Claim as `host`, registered (again: same instance, same epoch) with this max_runs first."""
    return store.claim(conn, register(conn, host, max_runs=max_runs), batch, unitspec.UNIT_NAME_FORMAT)


def claim_one(conn: psycopg.Connection, host: str = "h1") -> Attempt:
    [(_, attempt)] = claim(conn, host, batch=1)
    return attempt


def mark_started(conn: psycopg.Connection, attempt: Attempt, invocation_id: str | None,
                 reason: str | None = None) -> None:
    """store.mark_started as the attempt's own host."""
    store.mark_started(conn, fence_of(conn, attempt.host_id), attempt, invocation_id, reason)


def record_outcome(conn: psycopg.Connection, attempt: Attempt, outcome: Outcome, next_state: str,
                   retry_delay: timedelta | None = None) -> bool:
    """store.record_outcome as the attempt's own host."""
    return store.record_outcome(conn, fence_of(conn, attempt.host_id), attempt, outcome, next_state, retry_delay)


def started(conn: psycopg.Connection, host: str = "h1", **values: object) -> tuple[uuid.UUID, Attempt]:
    """A run that a host has claimed and whose unit is running."""
    run_id = submit(conn, **values)
    attempt = claim_one(conn, host)
    assert attempt.run_id == run_id
    mark_started(conn, attempt, f"inv-{run_id.hex[:8]}")
    return run_id, attempt


def cancel(conn: psycopg.Connection, run_id: uuid.UUID) -> tuple[str | None, bool]:
    """store.cancel_run's answer as (state after, changed)."""
    result = store.cancel_run(conn, run_id)
    return result.state, result.changed


def events(conn: psycopg.Connection, run_id: uuid.UUID) -> list[str]:
    return [e["state"] for e in store.get_events(conn, run_id, limit=100)]


def snapshot(conn: psycopg.Connection, run_id: uuid.UUID) -> tuple:
    """Everything the database holds about one run."""
    return (
        conn.execute("SELECT * FROM unitvisor.runs WHERE id = %s", (run_id,)).fetchall(),
        conn.execute("SELECT * FROM unitvisor.attempts WHERE run_id = %s ORDER BY attempt", (run_id,)).fetchall(),
        conn.execute("SELECT * FROM unitvisor.spawn_jobs WHERE run_id = %s ORDER BY id", (run_id,)).fetchall(),
        conn.execute("SELECT * FROM unitvisor.run_events WHERE run_id = %s ORDER BY id", (run_id,)).fetchall(),
    )


@pytest.fixture
def listener(dsn: str) -> psycopg.Connection:
    with store.connect(dsn) as connection:
        yield connection


# -- mark_started -------------------------------------------------------------------------------


def test_mark_started_moves_starting_to_running_once(conn: psycopg.Connection) -> None:
    run_id = submit(conn)
    attempt = claim_one(conn)
    assert store.get_run(conn, run_id).state == "starting"

    mark_started(conn, attempt, "invocation-1")
    run = store.get_run(conn, run_id)
    [row] = store.get_attempts(conn, run_id)
    assert run.state == "running"
    assert row.started_at is not None and row.invocation_id == "invocation-1"
    assert events(conn, run_id) == ["queued", "starting", "running"]
    running_event = store.get_events(conn, run_id)[-1]
    assert (running_event["attempt"], running_event["host_id"]) == (1, "h1")
    assert attempt.unit_name in running_event["reason"]

    # Again (adoption after a daemon restart): nothing changes, no second event.
    before = snapshot(conn, run_id)
    mark_started(conn, attempt, "invocation-2")
    mark_started(conn, attempt, None)
    assert snapshot(conn, run_id) == before
    assert events(conn, run_id).count("running") == 1


def test_mark_started_fills_in_a_missing_invocation_id(conn: psycopg.Connection) -> None:
    run_id = submit(conn)
    attempt = claim_one(conn)
    mark_started(conn, attempt, "")  # empty: unknown, stored as NULL
    [row] = store.get_attempts(conn, run_id)
    assert row.invocation_id is None and row.started_at is not None
    first_start = row.started_at
    mark_started(conn, attempt, "inv-later")
    [row] = store.get_attempts(conn, run_id)
    assert (row.invocation_id, row.started_at) == ("inv-later", first_start)
    assert events(conn, run_id).count("running") == 1


def test_mark_started_after_the_outcome_changes_nothing(conn: psycopg.Connection) -> None:
    run_id = submit(conn)
    attempt = claim_one(conn)
    assert record_outcome(conn, attempt, Outcome("start-failed", None, "no such binary"), "failed")
    before = snapshot(conn, run_id)
    mark_started(conn, attempt, "late")
    assert snapshot(conn, run_id) == before
    assert store.get_run(conn, run_id).state == "failed"


def test_mark_started_many_marks_a_batch_in_one_statement_as_mark_started_does(conn: psycopg.Connection) -> None:
    runs = [submit(conn) for _ in range(3)]
    attempts = sorted(claim(conn, batch=3), key=lambda pair: runs.index(pair[1].run_id))
    fence = fence_of(conn, "h1")
    store.mark_started_many(conn, fence, [])  # nothing to mark: no statement, no error
    store.mark_started_many(conn, fence, [a for _, a in attempts[:2]])
    assert [store.get_run(conn, r).state for r in runs] == ["running", "running", "starting"]
    for run_id, (_, attempt) in zip(runs[:2], attempts[:2], strict=True):
        [row] = store.get_attempts(conn, run_id)
        assert row.started_at is not None and row.invocation_id is None
        assert events(conn, run_id) == ["queued", "starting", "running"]
        assert store.get_events(conn, run_id)[-1]["reason"] == f"unit {attempt.unit_name} started"
    # Again, with one more: the marked ones change nothing, the new one moves.
    before = snapshot(conn, runs[0])
    store.mark_started_many(conn, fence, [a for _, a in attempts])
    assert snapshot(conn, runs[0]) == before
    assert store.get_run(conn, runs[2]).state == "running"


def test_mark_started_many_by_a_fenced_host_marks_none(conn: psycopg.Connection) -> None:
    runs = [submit(conn) for _ in range(2)]
    attempts = [a for _, a in claim(conn, batch=2)]
    stale = store.Fence("h1", fence_of(conn, "h1").epoch - 1)
    with pytest.raises(store.Fenced):
        store.mark_started_many(conn, stale, attempts)
    assert [store.get_run(conn, r).state for r in runs] == ["starting", "starting"]


# -- record_outcome -----------------------------------------------------------------------------


@pytest.mark.parametrize(("outcome", "next_state"), [
    (SUCCEEDED, "succeeded"), (FAILED, "failed"), (CANCELLED, "cancelled"),
    (Outcome("signal", "signal:KILL", "killed by signal KILL"), "failed"),
    (Outcome("lost", None, "the unit disappeared"), "failed"),
])
def test_record_outcome_writes_the_attempt_and_moves_the_run(conn: psycopg.Connection, outcome: Outcome,
                                                             next_state: str) -> None:
    # count_lost (schema 27): the lost attempt uses up the run's one attempt, as every lost one did before
    run_id, attempt = started(conn, count_lost=True)
    assert record_outcome(conn, attempt, outcome, next_state) is True

    [row] = store.get_attempts(conn, run_id)
    assert (row.outcome, row.exit_status, row.reason) == (outcome.outcome, outcome.exit_status, outcome.reason)
    assert row.ended_at is not None and row.ended_at >= row.started_at
    run = store.get_run(conn, run_id)
    assert run.state == next_state
    assert run.finished_at is not None and run.finished_at >= run.created_at
    last = store.get_events(conn, run_id)[-1]
    assert (last["state"], last["attempt"], last["host_id"]) == (next_state, 1, "h1")
    assert outcome.outcome in last["reason"]
    # No new job: the run is over.
    assert conn.execute("SELECT count(*) FROM unitvisor.spawn_jobs WHERE run_id = %s AND state = 'available'",
                        (run_id,)).fetchone()[0] == 0
    assert store.open_attempts(conn, "h1") == []


def test_a_recorded_outcome_is_never_overwritten(conn: psycopg.Connection) -> None:
    run_id, attempt = started(conn)
    assert record_outcome(conn, attempt, FAILED, "failed")
    before = snapshot(conn, run_id)
    assert record_outcome(conn, attempt, SUCCEEDED, "succeeded") is False
    assert record_outcome(conn, attempt, FAILED, "queued", retry_delay=timedelta(0)) is False
    assert snapshot(conn, run_id) == before
    [row] = store.get_attempts(conn, run_id)
    assert (row.outcome, row.exit_status) == ("exit-code", "exit:3")
    assert store.get_run(conn, run_id).state == "failed"


def test_record_outcome_with_a_retry_delay_requeues_the_run(conn: psycopg.Connection, listener) -> None:
    run_id, attempt = started(conn, max_attempts=2, priority=3)
    store.listen(listener, store.SPAWN_CHANNEL)
    assert record_outcome(conn, attempt, FAILED, "queued", retry_delay=timedelta(minutes=5))

    run = store.get_run(conn, run_id)
    assert run.state == "queued"
    assert run.finished_at is None
    [row] = store.get_attempts(conn, run_id)
    assert row.outcome == "exit-code" and row.ended_at is not None
    jobs = conn.execute(
        """SELECT state, priority, claimed_by, scheduled_at - now() FROM unitvisor.spawn_jobs
           WHERE run_id = %s ORDER BY id""", (run_id,)).fetchall()
    assert [j[:3] for j in jobs] == [("claimed", 3, "h1"), ("available", 3, None)]
    assert timedelta(minutes=4) < jobs[1][3] <= timedelta(minutes=5)
    last = store.get_events(conn, run_id)[-1]
    assert last["state"] == "queued" and "retry in 300s" in last["reason"]
    # Not claimable before its time, so it wakes no daemon (038): every host's heartbeat finds it then.
    assert wait_notifies(listener, timeout=0.5) == []
    assert claim(conn, "h1", 10, max_runs=10) == []


def test_record_outcomes_writes_a_batch_in_one_statement_as_record_outcome_does(conn: psycopg.Connection) -> None:
    """Each row as record_outcome writes it: a success with systemd's times and measurements, a failure
    retried after a delay, and one that had its outcome already (False, unchanged), in the given order."""
    done_id, done = started(conn)
    assert record_outcome(conn, done, FAILED, "failed")
    ok_id, ok = started(conn)
    retry_id, retry = started(conn, max_attempts=2)
    before = snapshot(conn, done_id)
    began, ended = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC), datetime(2026, 1, 2, 3, 4, 9, tzinfo=UTC)
    # Claimed and started before systemd's times: a host's times are kept within its attempt's life
    # (sql/013_fleet_promises.sql).
    conn.execute("UPDATE unitvisor.attempts SET claimed_at = %s, started_at = %s WHERE run_id = %s",
                 (began - timedelta(hours=1), began, ok_id))
    measured = Accounting(cpu_usage_nsec=1_500_000, io_read_bytes=4096)
    taken = store.record_outcomes(conn, fence_of(conn, "h1"), [
        store.Settling(retry, FAILED, "queued", timedelta(minutes=5)),
        store.Settling(done, SUCCEEDED, "succeeded"),
        store.Settling(ok, SUCCEEDED, "succeeded", None, "inv-ok", began, ended, measured),
    ])
    assert taken == [True, False, True]
    assert snapshot(conn, done_id) == before
    assert store.get_run(conn, retry_id).state == "queued"
    assert conn.execute("SELECT count(*) FROM unitvisor.spawn_jobs WHERE run_id = %s AND state = 'available'",
                        (retry_id,)).fetchone()[0] == 1
    [row] = store.get_attempts(conn, ok_id)
    assert (row.outcome, row.ended_at, row.invocation_id) == ("success", ended, f"inv-{ok_id.hex[:8]}")
    assert store.get_run(conn, ok_id).state == "succeeded"
    assert store.get_outcome_records(conn, ok_id)[1].accounting == measured
    assert store.record_outcomes(conn, fence_of(conn, "h1"), []) == []


def test_record_outcomes_is_all_or_nothing(conn: psycopg.Connection) -> None:
    """A fenced writer, or one row the function refuses (a negative measurement), writes none of them."""
    first_id, first = started(conn)
    second_id, second = started(conn)
    fence = fence_of(conn, "h1")
    bad = Accounting(cpu_usage_nsec=-1)
    with pytest.raises(psycopg.errors.CheckViolation):
        store.record_outcomes(conn, fence, [store.Settling(first, SUCCEEDED, "succeeded"),
                                            store.Settling(second, SUCCEEDED, "succeeded", accounting=bad)])
    stale = store.Fence("h1", fence.epoch - 1)
    with pytest.raises(store.Fenced):
        store.record_outcomes(conn, stale, [store.Settling(first, SUCCEEDED, "succeeded")])
    assert [store.get_run(conn, r).state for r in (first_id, second_id)] == ["running", "running"]
    assert store.open_attempts(conn, "h1") != []


def test_a_late_outcome_of_an_older_attempt_does_not_move_the_run(conn: psycopg.Connection) -> None:
    run_id, first = started(conn, max_attempts=3)
    # The run has moved on to attempt 2 (say the host lost track of attempt 1 and it was retried).
    conn.execute("INSERT INTO unitvisor.attempts (run_id, attempt, host_id, unit_name) VALUES (%s, 2, 'h2', %s)",
                 (run_id, unitspec.unit_name(run_id, 2)))
    before_events = events(conn, run_id)
    assert record_outcome(conn, first, FAILED, "failed") is True
    assert store.get_run(conn, run_id).state == "running"
    assert events(conn, run_id) == before_events
    assert [a.outcome for a in store.get_attempts(conn, run_id)] == ["exit-code", None]


def test_a_retry_does_not_requeue_a_run_whose_cancel_was_requested(conn: psycopg.Connection) -> None:
    run_id, attempt = started(conn, max_attempts=3)
    # The daemon read the run (no cancel yet), saw the unit fail and decided to retry; meanwhile an
    # operator cancels the run.
    assert cancel(conn, run_id) == ("running", True)
    record_outcome(conn, attempt, FAILED, "queued", retry_delay=timedelta(0))
    available = conn.execute("SELECT count(*) FROM unitvisor.spawn_jobs WHERE run_id = %s AND state = 'available'",
                             (run_id,)).fetchone()[0]
    assert (store.get_run(conn, run_id).state, available) == ("cancelled", 0)


# -- cancel_run ---------------------------------------------------------------------------------


def test_cancel_a_queued_run_cancels_at_once(conn: psycopg.Connection, listener) -> None:
    run_id = submit(conn)
    store.listen(listener, store.CANCEL_CHANNEL)

    assert cancel(conn, run_id) == ("cancelled", True)
    run = store.get_run(conn, run_id)
    assert run.state == "cancelled"
    assert run.finished_at is not None and run.cancel_requested_at is not None
    assert conn.execute("SELECT count(*) FROM unitvisor.spawn_jobs WHERE run_id = %s", (run_id,)).fetchone()[0] == 0
    assert events(conn, run_id) == ["queued", "cancelled"]

    # No daemon has anything to do for it: told to nobody (048).
    assert wait_notifies(listener, timeout=0.3) == []
    # Nothing to claim any more.
    assert claim(conn, "h1", 10, max_runs=10) == []
    assert store.get_attempts(conn, run_id) == []


def test_cancel_notification_received_through_pgconn(conn: psycopg.Connection, listener) -> None:
    """A running run's cancel, read the low-level way: consume_input, then pgconn.notifies()."""
    run_id, _ = started(conn)
    store.listen(listener, store.CANCEL_CHANNEL)
    store.cancel_run(conn, run_id)
    got = []
    for _ in range(50):
        select.select([listener.pgconn.socket], [], [], 0.1)
        listener.pgconn.consume_input()
        while (note := listener.pgconn.notifies()) is not None:
            got.append((note.relname.decode(), note.extra.decode()))
        if got:
            break
    assert got == [(store.CANCEL_CHANNEL, str(run_id))]


def test_cancel_a_waiting_retry_removes_its_job(conn: psycopg.Connection) -> None:
    run_id, attempt = started(conn, max_attempts=3)
    record_outcome(conn, attempt, FAILED, "queued", retry_delay=timedelta(minutes=10))
    assert cancel(conn, run_id) == ("cancelled", True)
    states = conn.execute("SELECT state FROM unitvisor.spawn_jobs WHERE run_id = %s", (run_id,)).fetchall()
    assert states == [("claimed",)]
    assert store.get_run(conn, run_id).finished_at is not None


@pytest.mark.parametrize("state", ["starting", "running"])
def test_cancel_a_starting_or_running_run_marks_it(conn: psycopg.Connection, listener, state: str) -> None:
    run_id = submit(conn)
    attempt = claim_one(conn)
    if state == "running":
        mark_started(conn, attempt, "inv")
    store.listen(listener, store.CANCEL_CHANNEL)

    assert cancel(conn, run_id) == (state, True)
    run = store.get_run(conn, run_id)
    assert run.state == state
    assert run.cancel_requested_at is not None
    assert run.finished_at is None
    assert events(conn, run_id)[-1] == state
    assert "cancel requested" in store.get_events(conn, run_id)[-1]["reason"]
    [note] = wait_notifies(listener)
    assert (note.channel, note.payload) == (store.CANCEL_CHANNEL, str(run_id))
    # The daemon finds it among its cancel-requested attempts.
    assert [a.run_id for _, a in store.open_attempts(conn, "h1", cancel_requested=True)] == [run_id]

    # Asking again keeps the first request time.
    first = run.cancel_requested_at
    store.cancel_run(conn, run_id)
    assert store.get_run(conn, run_id).cancel_requested_at == first


@pytest.mark.parametrize(("outcome", "final"), [(SUCCEEDED, "succeeded"), (FAILED, "failed"),
                                                (CANCELLED, "cancelled")])
def test_cancel_a_finished_run_changes_nothing(conn: psycopg.Connection, listener, outcome: Outcome,
                                               final: str) -> None:
    run_id, attempt = started(conn)
    record_outcome(conn, attempt, outcome, final)
    before = snapshot(conn, run_id)
    store.listen(listener, store.CANCEL_CHANNEL)
    assert cancel(conn, run_id) == (final, False)
    assert snapshot(conn, run_id) == before
    assert wait_notifies(listener, timeout=0.5) == []


def test_cancel_an_unknown_run(conn: psycopg.Connection) -> None:
    assert cancel(conn, uuid.uuid4()) == (None, False)
    assert conn.execute("SELECT count(*) FROM unitvisor.run_events").fetchone()[0] == 0


def test_cancel_during_a_claim_waits_and_then_asks_the_host(conn: psycopg.Connection, dsn: str) -> None:
    """A claim holds the job's lock until it commits; a cancel meanwhile waits for it, then finds the
    run starting (and marks it) rather than deleting a job that is already claimed."""
    run_id = submit(conn)
    result: list[tuple[str | None, bool]] = []
    errors: list[BaseException] = []

    def cancel_in_thread() -> None:
        try:
            with store.connect(dsn) as other:
                other.execute("SET statement_timeout = '30s'")
                result.append(cancel(other, run_id))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    fence = register(conn, "h1", max_runs=10)
    with conn.transaction():
        [(_, attempt)] = store.claim(conn, fence, 1, unitspec.UNIT_NAME_FORMAT)
        thread = threading.Thread(target=cancel_in_thread)
        thread.start()
        with store.connect(dsn) as observer:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not errors:
                blocked = observer.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND query LIKE %s", ("%unitvisor.cancel_run(%",)).fetchone()[0]  # it deletes the job first
                if blocked:
                    break
                time.sleep(0.02)
            assert blocked == 1, "the cancel should wait for the claim's lock"
        assert not result
    thread.join(timeout=30)
    assert not errors, errors
    assert result == [("starting", True)]
    run = store.get_run(conn, run_id)
    assert run.state == "starting" and run.cancel_requested_at is not None
    assert store.get_attempts(conn, run_id) == [attempt]
    assert conn.execute("SELECT state FROM unitvisor.spawn_jobs WHERE run_id = %s", (run_id,)).fetchall() == [
        ("claimed",)]


def test_a_claim_during_a_cancel_skips_the_run(conn: psycopg.Connection, dsn: str) -> None:
    run_id = submit(conn)
    with store.connect(dsn) as other:
        other.execute("SET statement_timeout = '10s'")
        fence = register(other, "h1", max_runs=10)
        with conn.transaction():
            assert cancel(conn, run_id) == ("cancelled", True)  # not committed yet
            assert store.claim(other, fence, 10, unitspec.UNIT_NAME_FORMAT) == []
    assert store.get_run(conn, run_id).state == "cancelled"
    assert store.get_attempts(conn, run_id) == []
    assert store.claim(conn, fence, 10, unitspec.UNIT_NAME_FORMAT) == []


# -- the spawn notification ---------------------------------------------------------------------


def test_submit_notifies_the_spawn_channel(conn: psycopg.Connection, listener) -> None:
    register(conn, "h1")  # a host to name: a notification that names nobody is not sent (048)
    store.listen(listener, store.SPAWN_CHANNEL)
    submit(conn)
    [note] = wait_notifies(listener)
    assert note.channel == store.SPAWN_CHANNEL
    # Through the SQL function directly, too.
    conn.execute("SELECT unitvisor.submit_run(ARRAY['/bin/true'])")
    assert [n.channel for n in wait_notifies(listener)] == [store.SPAWN_CHANNEL]


def test_a_rolled_back_submit_notifies_nobody(conn: psycopg.Connection, listener) -> None:
    store.listen(listener, store.SPAWN_CHANNEL)
    with conn.transaction():
        submit(conn)
        raise psycopg.Rollback()
    assert wait_notifies(listener, timeout=0.5) == []


def test_a_batch_submitted_in_one_transaction_notifies_once(conn: psycopg.Connection, listener) -> None:
    register(conn, "h1")
    store.listen(listener, store.SPAWN_CHANNEL)
    with conn.transaction():
        for _ in range(20):
            submit(conn)
    # NOTIFY folds identical notifications of one transaction into one.
    assert len(wait_notifies(listener, timeout=1.0, count=100)) == 1


# -- open_attempts ------------------------------------------------------------------------------


def test_open_attempts_filters(conn: psycopg.Connection) -> None:
    ids = [submit(conn) for _ in range(4)]
    mine = [claim_one(conn, "h1") for _ in range(3)]
    theirs = claim_one(conn, "h2")
    assert {a.run_id for a in mine} | {theirs.run_id} == set(ids)

    every = store.open_attempts(conn, "h1")
    assert [a for _, a in every] == mine  # in claim order
    assert all(run.id == a.run_id for run, a in every)
    assert [a for _, a in store.open_attempts(conn, "h2")] == [theirs]
    assert store.open_attempts(conn, "nobody") == []

    names = [mine[0].unit_name, mine[2].unit_name, theirs.unit_name, "unitvisor-run-nothing.service"]
    assert [a for _, a in store.open_attempts(conn, "h1", unit_names=names)] == [mine[0], mine[2]]
    assert store.open_attempts(conn, "h1", unit_names=[]) == []

    assert store.open_attempts(conn, "h1", cancel_requested=True) == []
    store.cancel_run(conn, mine[1].run_id)
    store.cancel_run(conn, theirs.run_id)
    [(run, attempt)] = store.open_attempts(conn, "h1", cancel_requested=True)
    assert attempt == mine[1] and run.cancel_requested_at is not None
    assert store.open_attempts(conn, "h1", unit_names=[mine[0].unit_name], cancel_requested=True) == []

    # An attempt with an outcome is no longer open.
    record_outcome(conn, mine[1], CANCELLED, "cancelled")
    assert [a for _, a in store.open_attempts(conn, "h1")] == [mine[0], mine[2]]
    assert store.open_attempts(conn, "h1", cancel_requested=True) == []
    owners = store.unit_owners(conn, [a.unit_name for a in mine])
    assert owners == {mine[0].unit_name: store.UnitOwner("h1", None),
                      mine[1].unit_name: store.UnitOwner("h1", "cancelled"),
                      mine[2].unit_name: store.UnitOwner("h1", None)}


# -- hosts --------------------------------------------------------------------------------------


def test_open_attempts_reads_each_run_whole_in_the_same_statement(conn: psycopg.Connection) -> None:
    """open_attempts joins the runs in (one statement per batch of unit changes): each run as get_run
    reads it, every field, also the computed wait_reason and the JSON columns (a dead host's attempts,
    read by the host taking them over: tests/integration/test_roles.py)."""
    run_id = submit(conn, environment={"A": "1"}, labels={"team": "x"}, priority=3, max_attempts=2)
    attempt = claim_one(conn, "h1")
    mark_started(conn, attempt, "inv-1")
    [(run, got)] = store.open_attempts(conn, "h1")
    assert run == store.get_run(conn, run_id) and run.state == "running"
    assert (run.environment, run.labels, run.priority) == ({"A": "1"}, {"team": "x"}, 3)
    assert got.invocation_id == "inv-1" and got.started_at is not None


def host_row(conn: psycopg.Connection, host_id: str) -> tuple:
    return conn.execute("SELECT name, state, max_runs, memory_budget, version, boot_id, started_at, heartbeat_at "
                        "FROM unitvisor.hosts WHERE id = %s", (host_id,)).fetchone()


def profile_row(conn: psycopg.Connection, host_id: str) -> tuple:
    return conn.execute(
        """SELECT instance, epoch, allowed_executables, executable_patterns, run_user, allowed_users, can_start,
                  cannot_start_reason, poll_interval_sec, dead_after_sec
           FROM unitvisor.hosts WHERE id = %s""", (host_id,)).fetchone()


WEEK = timedelta(days=7)  # `waited` for probes that are not about fleet upkeep


def test_register_host_inserts_then_updates(conn: psycopg.Connection) -> None:
    first = host_profile("h1", name="box-1", max_runs=8, budget=1 << 30, version="0.1.0", boot_id="boot-a",
                         allowed=("/usr/bin/*",), users=("nobody",), run_user="svc", dead_after=45.0,
                         poll_interval=5.0)
    assert store.register_host(conn, first) == store.Registration(True, "active", 1, "registered")
    name, state, max_runs, budget, version, boot, _, _ = host_row(conn, "h1")
    assert (name, state, max_runs, budget, version, boot) == ("box-1", "active", 8, 1 << 30, "0.1.0", "boot-a")
    assert profile_row(conn, "h1") == ("inst-h1", 1, ["/usr/bin/*"], [globs.glob_regex("/usr/bin/*")], "svc",
                                       ["nobody"], True, None, 5.0, 45.0)

    # The same instance again (a restart, a reconnect): the same epoch, the row follows the profile.
    second = host_profile("h1", name="box-1b", max_runs=16, budget=None, version="0.2.0", boot_id="boot-b",
                          can_start=False, cannot_start_reason="no systemd")
    assert store.register_host(conn, second) == store.Registration(True, "active", 1, "registered")
    name, state, max_runs, budget, version, boot, _, _ = host_row(conn, "h1")
    assert (name, state, max_runs, budget, version, boot) == ("box-1b", "active", 16, None, "0.2.0", "boot-b")
    assert profile_row(conn, "h1") == ("inst-h1", 1, list(second.allowed_executables),
                                       list(second.executable_patterns), "", [], False, "no systemd", 10.0, 60.0)
    assert conn.execute("SELECT count(*) FROM unitvisor.hosts").fetchone()[0] == 1


def test_register_host_keeps_draining_and_revives_stopped(conn: psycopg.Connection) -> None:
    fence = register(conn, "h1", max_runs=8)
    conn.execute("UPDATE unitvisor.hosts SET state = 'draining' WHERE id = 'h1'")
    registration = store.register_host(conn, host_profile("h1", max_runs=4))
    assert registration == store.Registration(True, "draining", fence.epoch, "registered")
    assert host_row(conn, "h1")[1:3] == ("draining", 4)

    store.mark_host_stopped(conn, fence)  # a draining host stops drained (schema 24), and comes back draining
    assert host_row(conn, "h1")[1] == "stopped"
    assert store.register_host(conn, host_profile("h1", max_runs=4)).state == "draining"

    conn.execute("UPDATE unitvisor.hosts SET state = 'active' WHERE id = 'h1'")
    store.mark_host_stopped(conn, store.Fence("h1", fence.epoch + 1))  # not its epoch: nothing happens
    assert host_row(conn, "h1")[1] == "active"
    store.mark_host_stopped(conn, fence)
    assert host_row(conn, "h1")[1] == "stopped"
    assert store.register_host(conn, host_profile("h1")) == store.Registration(True, "active", fence.epoch,
                                                                                 "registered")


def test_probe_is_the_heartbeat(conn: psycopg.Connection) -> None:
    h1 = register(conn, "h1", max_runs=8)
    register(conn, "h2", max_runs=8)
    conn.execute("UPDATE unitvisor.hosts SET heartbeat_at = now() - interval '1 hour'")
    old = host_row(conn, "h1")[7]

    # upkeep: h2 has been silent for longer than its host_dead_after.
    assert store.probe(conn, h1, WEEK) == store.Probe("active", False, False, True)
    new = host_row(conn, "h1")[7]
    assert new > old + timedelta(minutes=59)
    assert new <= store.now(conn)
    assert host_row(conn, "h2")[7] == old  # only the named host
    silence(conn, "h2", 0)
    assert store.probe(conn, h1, WEEK) == store.Probe("active", False, False, False)
    conn.execute("UPDATE unitvisor.hosts SET state = 'draining' WHERE id = 'h1'")
    assert store.probe(conn, h1, WEEK).host_state == "draining"

    # Not this host's epoch, or no such host: fenced, and no heartbeat is written.
    silence(conn, "h1", 600)
    stale = host_row(conn, "h1")[7]
    with pytest.raises(store.Fenced):
        store.probe(conn, store.Fence("h1", h1.epoch + 1), WEEK)
    with pytest.raises(store.Fenced):
        store.probe(conn, store.Fence("unknown", 1), WEEK)
    assert host_row(conn, "h1")[7] == stale


def test_probe_says_whether_there_is_work(conn: psycopg.Connection) -> None:
    fence = register(conn, "h1", max_runs=8)
    pinned_elsewhere = store.submit_run(conn, argv=["/bin/true"], host_pin="h2")
    assert store.probe(conn, fence, WEEK) == store.Probe("active", False, False, False)
    store.submit_run(conn, argv=["/bin/true"])
    assert store.probe(conn, fence, WEEK).claimable is True
    conn.execute("UPDATE unitvisor.spawn_jobs SET scheduled_at = now() + interval '1 hour'")
    assert store.probe(conn, fence, WEEK).claimable is False
    conn.execute("UPDATE unitvisor.spawn_jobs SET scheduled_at = now()")
    [(run, _)] = store.claim(conn, fence, 5, unitspec.UNIT_NAME_FORMAT)
    assert run.id != pinned_elsewhere
    assert run.state == "starting"
    assert store.probe(conn, fence, WEEK) == store.Probe("active", False, False, False)
    store.cancel_run(conn, run.id)
    assert store.probe(conn, fence, WEEK).cancels is True
    # upkeep: a job has waited for longer than `waited` (here: the one pinned to the unknown h2), seen by
    # the first heartbeat a poll interval after the last look that found nothing (040).
    assert store.probe(conn, fence, timedelta(0)).upkeep is False
    look_again(conn)
    assert store.probe(conn, fence, timedelta(0)).upkeep is True


def test_resume_keeps_a_job_left_behind_instead_of_failing_on_it(conn: psycopg.Connection) -> None:
    """A job an older race left behind (say, a retry's job that committed after a cancel, before that
    race was fixed): resume must not fail with a unique violation, and the run gets one job."""
    run_id = submit(conn)
    assert store.cancel_run(conn, run_id) == store.Transition("cancelled", True)
    conn.execute("INSERT INTO unitvisor.spawn_jobs (run_id) VALUES (%s)", (run_id,))  # the stale job
    assert store.resume_run(conn, run_id) == store.Transition("queued", True)
    assert conn.execute("SELECT count(*) FROM unitvisor.spawn_jobs WHERE run_id = %s AND state = 'available'",
                        (run_id,)).fetchone()[0] == 1
    h1 = register(conn, "h1")
    assert [a.run_id for _, a in store.claim(conn, h1, 10, unitspec.UNIT_NAME_FORMAT)] == [run_id]

"""Retention (sql/008_retention.sql): what unitvisor.prune deletes and what it keeps, in batches, dry,
one pruner at a time; and prune_history, the host's way in."""

from __future__ import annotations

import uuid
from datetime import timedelta

import psycopg
import pytest

from supervisor import store, unitspec
from supervisor.model import TERMINAL_STATES
from supervisor.outcomes import Outcome
from tests.integration.conftest import age_jobs, register

FMT = unitspec.UNIT_NAME_FORMAT
SUCCESS = Outcome("success", "exit:0", "exited 0")
DAY = timedelta(days=1)


def finished_run(conn: psycopg.Connection, fence: store.Fence, days_ago: float, state: str = "succeeded") -> uuid.UUID:
    """A run submitted, claimed and settled, then made `days_ago` old (its finish and its job's claim)."""
    run_id = store.submit_run(conn, argv=["/bin/true"])
    age_jobs(conn)
    [(_, attempt)] = store.claim(conn, fence, 1, FMT)
    store.record_event(conn, fence, attempt, "running", "an event of its own")
    outcome = SUCCESS if state == "succeeded" else Outcome("exit-code", "exit:1", "exited 1")
    assert store.record_outcome(conn, fence, attempt, outcome, state)
    backdate(conn, run_id, days_ago)
    return run_id


def backdate(conn: psycopg.Connection, run_id: uuid.UUID, days_ago: float) -> None:
    conn.execute("UPDATE unitvisor.runs SET finished_at = now() - make_interval(days => %s) "
                 "WHERE id = %s AND finished_at IS NOT NULL", (days_ago, run_id))
    conn.execute("UPDATE unitvisor.spawn_jobs SET claimed_at = now() - make_interval(days => %s) "
                 "WHERE run_id = %s AND state <> 'available'", (days_ago, run_id))


def rows_of(conn: psycopg.Connection, run_id: uuid.UUID) -> dict[str, int]:
    return {table: conn.execute(f"SELECT count(*) FROM unitvisor.{table} WHERE {key} = %s", (run_id,)).fetchone()[0]
            for table, key in (("runs", "id"), ("attempts", "run_id"), ("run_events", "run_id"),
                               ("spawn_jobs", "run_id"), ("run_waits", "run_id"))}


def prune_all(conn: psycopg.Connection, older_than: timedelta, batch_size: int = 1000) -> store.Pruned:
    total = store.Pruned(0, 0, 0, 0)
    while True:
        batch = store.prune_batch(conn, older_than, batch_size)
        assert not batch.busy
        total += batch
        if not batch.full(batch_size):
            return total


@pytest.fixture
def fence(conn: psycopg.Connection) -> store.Fence:
    return register(conn, "h1", max_runs=100)


def test_prune_deletes_old_finished_runs_with_everything_of_theirs(conn, fence) -> None:
    old = [finished_run(conn, fence, 40, state) for state in ("succeeded", "failed")]
    cancelled = store.submit_run(conn, argv=["/bin/true"])
    store.cancel_run(conn, cancelled)  # cancelled while queued: no attempt, its job deleted
    backdate(conn, cancelled, 40)
    conn.execute("INSERT INTO unitvisor.run_waits (run_id, reason) VALUES (%s, 'a stale reason')", (old[0],))
    # A stale available job of a finished run (a retry that raced a cancel): only the run held it.
    conn.execute("INSERT INTO unitvisor.spawn_jobs (run_id) VALUES (%s)", (old[1],))

    pruned = prune_all(conn, timedelta(days=30))

    # Each settled run: submitted, starting, running (its own event), succeeded/failed = 4 events.
    assert pruned == store.Pruned(runs=3, attempts=2, events=4 + 4 + 2, jobs=3, busy=False)
    for run_id in (*old, cancelled):
        assert rows_of(conn, run_id) == dict.fromkeys(("runs", "attempts", "run_events", "spawn_jobs", "run_waits"), 0)


def test_prune_keeps_young_live_and_open_runs_and_jobs_of_kept_runs(conn, fence) -> None:
    young = finished_run(conn, fence, 10)
    queued = store.submit_run(conn, argv=["/bin/true"], host_pin="h2")  # waits: h1 never claims it
    conn.execute("UPDATE unitvisor.runs SET created_at = now() - interval '90 days' WHERE id = %s", (queued,))
    running = store.submit_run(conn, argv=["/bin/true"])
    age_jobs(conn)
    [(_, attempt)] = store.claim(conn, fence, 1, FMT)
    assert attempt.run_id == running
    store.mark_started(conn, fence, attempt, "inv-1")
    backdate(conn, running, 40)  # its job was claimed 40 days ago: history, deleted; the run stays
    # A run marked failed long ago by hand while its attempt is still open: kept, whatever its state says.
    open_one = store.submit_run(conn, argv=["/bin/true"])
    age_jobs(conn)
    [(_, open_attempt)] = store.claim(conn, fence, 1, FMT)
    conn.execute("UPDATE unitvisor.runs SET state = 'failed', finished_at = now() - interval '90 days' "
                 "WHERE id = %s", (open_one,))
    before = {run_id: rows_of(conn, run_id) for run_id in (young, queued, running, open_one)}

    pruned = prune_all(conn, timedelta(days=30))

    assert pruned == store.Pruned(runs=0, attempts=0, events=0, jobs=1, busy=False)
    after = {run_id: rows_of(conn, run_id) for run_id in (young, queued, running, open_one)}
    assert after == {**before, running: {**before[running], "spawn_jobs": 0}}
    assert conn.execute("SELECT state FROM unitvisor.spawn_jobs WHERE run_id = %s", (queued,)).fetchall() == \
        [("available",)]
    assert store.get_attempts(conn, open_one)[0].outcome is None and open_attempt.run_id == open_one


def test_prune_works_in_batches_oldest_first(conn, fence) -> None:
    runs = [finished_run(conn, fence, 40 + i) for i in range(5)]  # runs[4] is the oldest
    first = store.prune_batch(conn, timedelta(days=30), 2)
    assert (first.runs, first.full(2)) == (2, True)
    assert {run_id for run_id in runs if store.get_run(conn, run_id) is None} == set(runs[3:])
    second = store.prune_batch(conn, timedelta(days=30), 2)
    third = store.prune_batch(conn, timedelta(days=30), 2)
    assert [second.runs, third.runs, third.full(2)] == [2, 1, False]
    assert store.prune_batch(conn, timedelta(days=30), 2) == store.Pruned(0, 0, 0, 0, False)


def test_a_dry_run_counts_everything_and_deletes_nothing(conn, fence) -> None:
    for days in (40, 50, 60):
        finished_run(conn, fence, days)
    finished_run(conn, fence, 5)
    counts_before = conn.execute("SELECT (SELECT count(*) FROM unitvisor.runs), "
                                 "(SELECT count(*) FROM unitvisor.run_events)").fetchone()
    dry = store.prune_count(conn, timedelta(days=30))
    assert conn.execute("SELECT (SELECT count(*) FROM unitvisor.runs), "
                        "(SELECT count(*) FROM unitvisor.run_events)").fetchone() == counts_before
    assert dry == prune_all(conn, timedelta(days=30), batch_size=1)
    assert dry == store.Pruned(runs=3, attempts=3, events=12, jobs=3, busy=False)


def test_one_pruner_at_a_time_the_other_is_told_busy(conn, fence, dsn) -> None:
    for days in (40, 50):
        finished_run(conn, fence, days)
    with store.connect(dsn) as other, other.transaction():
        mine = other.execute("SELECT runs, busy FROM unitvisor.prune(interval '30 days', 1)").fetchone()
        assert mine == (1, False)  # this session holds the lock until its transaction ends
        assert store.prune_batch(conn, timedelta(days=30), 10) == store.Pruned(0, 0, 0, 0, busy=True)
    assert store.prune_batch(conn, timedelta(days=30), 10).runs == 1


@pytest.mark.parametrize(("older_than", "batch_size", "message"), [
    (timedelta(0), 10, "older_than: must be more than zero"),
    (timedelta(days=-1), 10, "older_than: must be more than zero"),
    (DAY, 0, "batch_size: 0 is out of range"),
    (DAY, 100001, "batch_size: 100001 is out of range"),
])
def test_prune_refuses_bad_arguments(conn, older_than, batch_size, message) -> None:
    with pytest.raises(psycopg.errors.InvalidParameterValue, match=message):
        store.prune_batch(conn, older_than, batch_size)


def test_a_host_prunes_through_prune_history_with_its_fence(conn, fence) -> None:
    run_id = finished_run(conn, fence, 40)
    assert store.prune_batch(conn, timedelta(days=30), 10, fence).runs == 1
    assert store.get_run(conn, run_id) is None


@pytest.mark.parametrize(("older_than", "batch_size", "message"), [
    (timedelta(minutes=59), 10, "a host prunes only runs finished at least 01:00:00 ago"),
    (DAY, 10001, "batch_size: 10001 is out of range"),
])
def test_prune_history_refuses_a_young_age_or_a_large_batch(conn, fence, older_than, batch_size, message) -> None:
    finished_run(conn, fence, 40)
    with pytest.raises(psycopg.errors.InvalidParameterValue, match=message):
        store.prune_batch(conn, older_than, batch_size, fence)


def test_a_fenced_host_prunes_nothing(conn, fence) -> None:
    run_id = finished_run(conn, fence, 40)
    with pytest.raises(store.Fenced):
        store.prune_batch(conn, timedelta(days=30), 10, store.Fence(fence.host_id, fence.epoch + 1000))
    assert store.get_run(conn, run_id) is not None


def test_prune_knows_every_table_that_refers_to_runs_or_attempts(conn) -> None:
    """A later migration's table that refers to a run or an attempt must be pruned with it (unitvisor.prune
    deletes the children it knows explicitly, to count them): this names them, so that one added
    without a change to prune fails here instead of keeping rows, or failing a batch, for ever."""
    children = conn.execute(
        """SELECT c.conrelid::regclass::text, c.confrelid::regclass::text, c.confdeltype FROM pg_constraint c
           WHERE c.contype = 'f' AND c.confrelid IN ('unitvisor.runs'::regclass, 'unitvisor.attempts'::regclass)
           ORDER BY 1""").fetchall()
    # run_dependencies (035): a run's rows go with either run it joins, by the cascade, uncounted (they are
    # no history of their own); prune keeps a run that a run not yet ended names (needed_by_live_run).
    assert children == [("unitvisor.attempts", "unitvisor.runs", "c"),
                        ("unitvisor.run_dependencies", "unitvisor.runs", "c"),
                        ("unitvisor.run_dependencies", "unitvisor.runs", "c"),
                        ("unitvisor.run_events", "unitvisor.runs", "c"),
                        ("unitvisor.run_waits", "unitvisor.runs", "c"), ("unitvisor.spawn_jobs", "unitvisor.runs", "c")]


def test_retention_knows_every_terminal_state(conn) -> None:
    """A run state added later (006's `expired`) must be retention's too, or its runs stay for ever."""
    assert set(conn.execute("SELECT unitvisor.retention_states()").fetchone()[0]) == TERMINAL_STATES


def test_prune_deletes_old_expired_runs(conn, fence) -> None:
    run_id = store.submit_run(conn, argv=["/bin/true"], host_pin="h2", start_deadline="2100-01-01Z")
    conn.execute("UPDATE unitvisor.runs SET start_deadline = now() - interval '1 second' WHERE id = %s", (run_id,))
    assert store.expire_runs(conn, fence) == 1
    backdate(conn, run_id, 40)

    assert prune_all(conn, timedelta(days=30)).runs == 1
    assert rows_of(conn, run_id)["runs"] == 0

"""A job just submitted is the work of the hosts its submit woke: another host's heartbeat does not count it
until it is `left_to_woken` old, and then counts it at once (sql/migrations/047_fresh_jobs_left_to_the_woken.sql;
issue 23: on 1,000 hosts one submit drew about one empty claim for every 10 ms it waited, from heartbeats
that fell in that window).

What must not change: the claim itself (the woken host takes the job at once), a job made due later
(notified to nobody), a keyed job, a job whose submit took longer than the grace, a caller that passes no
grace (a 0.11.0 daemon), and the fallback: a "no" is kept no longer than the grace, so that a job its woken
hosts did not take is found by the next heartbeat after it, with nothing else in the fleet moving.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import psycopg

from supervisor import fleet, store
from tests.integration.conftest import calls_during, register
from tests.integration.test_claim_gate import FMT, submit
from tests.integration.test_migrate_operations import sql_dir_up_to

WAITED = timedelta(seconds=20)
GRACE = timedelta(seconds=1)


def heartbeat(conn: psycopg.Connection, fence: store.Fence, left_to_woken: timedelta = GRACE) -> tuple[bool, bool]:
    """One heartbeat, committed (the "no" it keeps is what the next one reads): (claimable, walked)."""
    probe, calls = calls_during(conn, lambda: store.probe(conn, fence, WAITED, left_to_woken), commit=True)
    return probe.claimable, "host_has_work" in calls


def past_the_grace(conn: psycopg.Connection) -> None:
    """Sleep until the newest available job is older than GRACE by the database's clock."""
    left = conn.execute("SELECT extract(epoch FROM max(created_at) + %s - clock_timestamp())::float8 "
                        "FROM unitvisor.spawn_jobs WHERE state = 'available'", (GRACE,)).fetchone()[0]
    conn.commit()
    time.sleep(max(0.0, left) + 0.05)


def test_the_daemon_leaves_jobs_for_its_spread_grace() -> None:
    assert fleet.LEFT_TO_WOKEN == timedelta(seconds=fleet.SPREAD_GRACE)
    assert fleet.LEFT_TO_WOKEN.total_seconds() < fleet.RECLAIM_AFTER  # the reclaim's probe sees the shares' leftovers


def test_a_job_just_submitted_is_no_work_for_a_heartbeat_until_the_grace_then_it_is(
        conn: psycopg.Connection, dsn: str) -> None:
    with store.connect(dsn) as other:
        h1 = register(conn, "h1")
        h2 = register(other, "h2")
        submit(conn, 1)
        assert heartbeat(conn, h1) == (False, True)
        assert heartbeat(other, h2, timedelta(0)) == (True, True)  # a caller that gives no grace: as before 047
        past_the_grace(conn)
        assert heartbeat(conn, h1) == (True, True)


def test_the_kept_no_ends_with_the_grace_with_nothing_else_moving(conn: psycopg.Connection) -> None:
    """The fallback for a job whose woken hosts did not take it: the "no" kept on the host row (041) holds
    until the job is left no more, not for 30 poll intervals, though no job, event or host changed."""
    h1 = register(conn, "h1")
    submit(conn, 1)
    assert heartbeat(conn, h1) == (False, True)
    assert heartbeat(conn, h1) == (False, False)  # kept: no walk
    until, created = conn.execute("SELECT h.work_until, j.created_at FROM unitvisor.hosts h, unitvisor.spawn_jobs j "
                                  "WHERE h.id = 'h1' AND j.state = 'available'").fetchone()
    assert until == created + GRACE
    past_the_grace(conn)
    assert heartbeat(conn, h1) == (True, True)


def test_the_woken_host_claims_the_job_at_once(conn: psycopg.Connection, dsn: str) -> None:
    with store.connect(dsn) as other:
        h1 = register(conn, "h1")
        h2 = register(other, "h2")
        submit(conn, 1)
        assert heartbeat(other, h2) == (False, True)
        assert len(store.claim(conn, h1, 32, FMT)) == 1


def test_a_job_due_later_was_notified_to_nobody_and_is_work_once_due(conn: psycopg.Connection) -> None:
    h1 = register(conn, "h1")
    conn.execute("SELECT unitvisor.submit_run(ARRAY['/bin/true'], not_before => now() + interval '0.3 seconds')")
    conn.commit()
    assert heartbeat(conn, h1, timedelta(seconds=30)) == (False, True)
    time.sleep(0.4)
    assert heartbeat(conn, h1, timedelta(seconds=30)) == (True, True)


def test_a_keyed_job_is_not_left(conn: psycopg.Connection) -> None:
    """The key's room decided whom its submit woke: the heartbeat's walk of keys is unchanged."""
    h1 = register(conn, "h1")
    submit(conn, 1, concurrency_key="k")
    assert heartbeat(conn, h1, timedelta(seconds=30)) == (True, True)


def test_a_job_older_than_the_grace_at_its_commit_is_work_at_once(conn: psycopg.Connection) -> None:
    """A submit that took longer than the grace (a burst inserted one run at a time): its jobs' NOTIFY came
    at the commit, but they are as old as the transaction, and every heartbeat counts them, as before."""
    h1 = register(conn, "h1")
    with conn.transaction():
        conn.execute("SELECT unitvisor.submit_run(ARRAY['/bin/true'])")
        time.sleep(GRACE.total_seconds() + 0.1)
    assert heartbeat(conn, h1) == (True, True)


def test_a_daemon_of_the_release_before_keeps_its_prepared_heartbeat_across_the_migration(
        empty_dsn: str, tmp_path: Path) -> None:
    """A rolling upgrade (store's migration rules): 047 replaces heartbeat by one with a fourth argument
    that defaults to no grace. A 0.11.0 daemon's three-argument statement, prepared before the migration,
    runs after it, and a job just submitted is still work for it, as before."""
    with store.connect(empty_dsn) as conn:
        store.migrate(conn, sql_dir_up_to(tmp_path, 46))
        fence = register(conn, "h1")
        old = "SELECT claimable FROM unitvisor.heartbeat(%s, %s, %s)"
        args = (fence.host_id, fence.epoch, WAITED)
        assert conn.execute(old, args, prepare=True).fetchone() == (False,)
        conn.commit()
        assert store.migrate(conn, sql_dir_up_to(tmp_path, 47)) == ["047_fresh_jobs_left_to_the_woken"]
        submit(conn, 1)
        assert conn.execute(old, args, prepare=True).fetchone() == (True,)
        conn.rollback()
        assert heartbeat(conn, fence) == (False, True)  # the new daemon's call leaves the job to the woken

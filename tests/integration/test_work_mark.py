"""A heartbeat walks the queue for "is there work for me" again only when something that could change its
"no" has changed (sql/migrations/041_heartbeat_work_mark.sql, issue 23, point 4: runs that nobody may
start added 2-3x to an idle fleet's server CPU, every heartbeat walking to the same "no").

Each way work comes to a host that had none is made the way the product makes it (a submit, an outcome,
an undrain, a registration, the clock), and the next heartbeat must say so. Walks are counted
(pg_stat_xact_user_functions: host_has_work's calls), not timed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import psycopg
import pytest

from supervisor import store
from supervisor.outcomes import Outcome
from tests.integration.conftest import ALLOW_ALL, age_jobs, calls_during, register
from tests.integration.test_claim_gate import FMT, submit

SUCCESS = Outcome("success", "exit:0", "exited 0")


def heartbeat(conn: psycopg.Connection, fence: store.Fence) -> tuple[bool, bool]:
    """One heartbeat, committed (the mark it leaves is what the next one reads): (claimable, walked)."""
    probe, calls = calls_during(conn, lambda: store.probe(conn, fence, timedelta(seconds=20)), commit=True)
    return probe.claimable, "host_has_work" in calls


def settled_no(conn: psycopg.Connection, fence: store.Fence) -> None:
    """The host has no work, walked for once, then not again while nothing changes."""
    assert heartbeat(conn, fence) == (False, True)
    assert heartbeat(conn, fence) == (False, False)
    assert heartbeat(conn, fence) == (False, False)


def end(conn: psycopg.Connection, fence: store.Fence, attempt: store.Attempt) -> None:
    store.mark_started(conn, fence, attempt, None)
    assert store.record_outcome(conn, fence, attempt, SUCCESS, "succeeded")


def test_runs_behind_a_key_are_walked_for_once_and_work_again_when_the_key_frees(
        conn: psycopg.Connection, dsn: str) -> None:
    with store.connect(dsn) as other:
        h1 = register(conn, "h1")
        h2 = register(other, "h2")
        submit(conn, 1, concurrency_key="k")
        [(_, blocker)] = store.claim(conn, h1, 10, FMT)
        submit(conn, 100, concurrency_key="k")
        settled_no(other, h2)
        end(conn, h1, blocker)  # an outcome: the key's head may start
        assert heartbeat(other, h2) == (True, True)
        assert len(store.claim(other, h2, 10, FMT)) == 1  # one at a time: the head only
        settled_no(other, h2)


def test_the_explanation_of_a_wait_is_no_work_and_moves_no_mark(conn: psycopg.Connection) -> None:
    """The fleet upkeep's `waiting: ...` events change no host's work (043): a heartbeat after a pass that
    wrote them does not walk again, and the newest-event probe stays one index probe however many there
    are. An event that is a change (a cancel) still moves the mark."""
    h1 = register(conn, "h1", allowed=("/bin/*",))
    submit(conn, 1000, argv0="/opt/rollout/new-binary")
    age_jobs(conn)
    settled_no(conn, h1)
    assert store.explain_waiting(conn, timedelta(seconds=1)) == 1000
    conn.commit()
    assert heartbeat(conn, h1) == (False, False)
    plan = "\n".join(row[0] for row in conn.execute(
        "EXPLAIN SELECT max(e.id) FROM unitvisor.run_events e "
        "WHERE NOT (e.state = 'queued' AND e.reason LIKE 'waiting: %')").fetchall())
    assert "run_events_change_idx" in plan, plan
    run = conn.execute("SELECT id FROM unitvisor.runs WHERE state = 'queued' LIMIT 1").fetchone()[0]
    conn.execute("SELECT unitvisor.cancel_run(%s)", (run,))
    conn.commit()
    assert heartbeat(conn, h1) == (False, True)


def drained_then_undrained(conn: psycopg.Connection, fence: store.Fence) -> Callable[[], None]:
    store.set_host_state(conn, fence.host_id, "draining")
    submit(conn, 1)
    return lambda: store.set_host_state(conn, fence.host_id, "active")


def refused_then_allowed(conn: psycopg.Connection, fence: store.Fence) -> Callable[[], None]:
    register(conn, fence.host_id, allowed=("/bin/*",))
    submit(conn, 1, argv0="/opt/rollout/new-binary")
    return lambda: register(conn, fence.host_id, allowed=ALLOW_ALL)  # the same daemon, its new allowlist


def full_then_a_slot_frees(conn: psycopg.Connection, fence: store.Fence) -> Callable[[], None]:
    register(conn, fence.host_id, max_runs=1)
    submit(conn, 1)
    [(_, running)] = store.claim(conn, fence, 10, FMT)
    submit(conn, 1)
    return lambda: end(conn, fence, running)


def refused_work_then_a_submit(conn: psycopg.Connection, fence: store.Fence) -> Callable[[], None]:
    register(conn, fence.host_id, allowed=("/bin/*",))
    submit(conn, 10, argv0="/opt/rollout/new-binary")
    return lambda: submit(conn, 1)


@pytest.mark.parametrize("change", [refused_work_then_a_submit, drained_then_undrained, refused_then_allowed,
                                    full_then_a_slot_frees])
def test_each_way_work_comes_to_a_host_moves_its_mark(
        conn: psycopg.Connection, change: Callable[[psycopg.Connection, store.Fence], Callable[[], None]]) -> None:
    h1 = register(conn, "h1")
    make_work = change(conn, h1)
    settled_no(conn, h1)
    make_work()
    assert heartbeat(conn, h1) == (True, True)


def test_a_run_not_due_yet_is_work_when_it_is_due_without_any_row_changing(conn: psycopg.Connection) -> None:
    h1 = register(conn, "h1")
    conn.execute("SELECT unitvisor.submit_run(ARRAY['/bin/true'], not_before => now() + interval '2 seconds')")
    settled_no(conn, h1)
    until = conn.execute("SELECT work_until - now() FROM unitvisor.hosts WHERE id = 'h1'").fetchone()[0]
    assert until <= timedelta(seconds=2)  # the job's own time, not 30 poll intervals
    time.sleep(until.total_seconds() + 0.2)
    assert heartbeat(conn, h1) == (True, True)


def test_a_submit_that_commits_behind_a_later_one_waits_for_the_bound_or_the_next_change(
        conn: psycopg.Connection, dsn: str) -> None:
    """The window the migration names: a job whose id was drawn before a later one's commit, and which
    commits after a heartbeat's walk, leaves that host's mark as it was. The host sees it when anything else
    changes, or 30 poll intervals after its walk (the submit's own NOTIFY, not exercised here, wakes it
    at once)."""
    h1 = register(conn, "h1", allowed=("/bin/*",))
    with store.connect(dsn) as early, store.connect(dsn) as late:
        with early.transaction():
            early.execute("SELECT unitvisor.submit_run(ARRAY['/bin/true'])")  # its job's id drawn, not committed
            late.execute("SELECT unitvisor.submit_run(ARRAY['/opt/rollout/new-binary'])")  # refused, committed
            assert heartbeat(conn, h1) == (False, True)
    assert heartbeat(conn, h1) == (False, False)  # the window: the early job is there, the mark as it was
    until = conn.execute("SELECT work_until - now() FROM unitvisor.hosts WHERE id = 'h1'").fetchone()[0]
    assert timedelta(seconds=290) < until <= timedelta(seconds=300)  # 30 poll intervals of 10 s
    conn.execute("UPDATE unitvisor.hosts SET work_until = now() WHERE id = 'h1'")  # as if they had passed
    assert heartbeat(conn, h1) == (True, True)


def test_a_yes_keeps_no_mark(conn: psycopg.Connection) -> None:
    h1 = register(conn, "h1")
    submit(conn, 1)
    assert heartbeat(conn, h1) == (True, True)
    assert heartbeat(conn, h1) == (True, True)  # not claimed yet: still work, walked for each time
    assert conn.execute("SELECT work_mark FROM unitvisor.hosts WHERE id = 'h1'").fetchone()[0] is None


def test_an_empty_queue_is_no_work_without_a_walk_or_a_mark(conn: psycopg.Connection) -> None:
    h1 = register(conn, "h1")
    assert heartbeat(conn, h1) == (False, False)  # one index probe: no job is available
    assert conn.execute("SELECT work_mark FROM unitvisor.hosts WHERE id = 'h1'").fetchone()[0] is None
    submit(conn, 1)
    assert heartbeat(conn, h1) == (True, True)

"""What a claim costs under a backlog (sql/009_claim_cost.sql, issue 14), counted, not timed: how many
times the claim calls host_refusal, the one per-row check that runs regular expressions (and that
also_accepted calls once more for other hosts). A claim's work must follow what it takes, not the
length of the queue: in 006 a claim of 5 runs over 500 queued jobs called it on every one of them,
twice, and with 300 hosts and 10,000 queued jobs each claim took most of a second.

The claim asks host_refusal once per kind of run it meets (argv[0], user, environment, memory_max), so
a backlog of one kind costs a call or two, whatever its length.

The counts come from pg_stat_xact_user_functions (track_functions = 'all', for this transaction only).
"""

from __future__ import annotations

import psycopg

from supervisor import store, unitspec
from tests.integration.conftest import calls_during, register

FMT = unitspec.UNIT_NAME_FORMAT
BACKLOG = 500


def submit_backlog(conn: psycopg.Connection, count: int, host_pin: str | None = None) -> None:
    conn.execute("SELECT unitvisor.submit_run(ARRAY['/bin/true'], host_pin => %s) FROM generate_series(1, %s)",
                 (host_pin, count))


def counted_claim(conn: psycopg.Connection, fence: store.Fence, batch: int) -> tuple[int, int]:
    """(runs taken, host_refusal calls) of one claim, rolled back."""
    taken, calls = calls_during(conn, lambda: conn.execute("SELECT run_id FROM unitvisor.claim_jobs(%s, %s, %s, %s)",
                                                           (fence.host_id, fence.epoch, batch, FMT)).fetchall(),
                                commit=False)
    return len(taken), calls.get("host_refusal", 0)


def test_a_claim_over_a_backlog_checks_about_as_many_jobs_as_it_takes(conn: psycopg.Connection, dsn: str) -> None:
    # Two hosts of room for the whole backlog: the fair share is in force, and its count of waiting jobs
    # could reach every queued job.
    with store.connect(dsn) as other:
        h1 = register(conn, "h1", max_runs=1000)
        register(other, "h2", max_runs=1000)
        submit_backlog(conn, BACKLOG)
        taken, calls = counted_claim(conn, h1, batch=5)
    assert taken == 5
    # The counter works here (the call is not inlined away) ...
    assert calls >= 1
    # ... and the claim asked about the rows it fetched at most (ten at a time), not about the backlog:
    # for this host, and through also_accepted for the first other host that takes it; once per kind
    # of run, in fact, and these 500 are of one kind.
    assert calls <= 4, calls


def test_a_backlog_pinned_to_another_host_costs_no_refusal_checks(conn: psycopg.Connection, dsn: str) -> None:
    with store.connect(dsn) as other:
        h1 = register(conn, "h1", max_runs=1000)
        h2 = register(other, "h2", max_runs=1000)
        submit_backlog(conn, BACKLOG, host_pin="h2")
        assert counted_claim(conn, h1, batch=5) == (0, 0)
        # The host they are pinned to still takes them (and checks the ones it takes).
        taken, calls = counted_claim(other, h2, batch=5)
    assert taken == 5 and 1 <= calls <= 4, (taken, calls)


def test_the_daemons_reads_of_its_runs_never_ask_why_they_wait(conn: psycopg.Connection) -> None:
    # wait_reason says why a queued run waits; the claim and open_attempts read runs this host is about to
    # start or holds open. A SQL function with a SET clause, it is planned at every call: 0.4 ms of a claim
    # of one run, on every run's path from its submit to its start (issue 27).
    fence = register(conn, "h1")
    submit_backlog(conn, 3)
    claimed, calls = calls_during(conn, lambda: store.claim(conn, fence, 3, FMT), commit=True)
    assert len(claimed) == 3 and all(run.wait_reason is None for run, _ in claimed)
    assert calls.get("claim_jobs") == 1, calls  # the counter works here
    assert "wait_reason" not in calls and "after_text" not in calls, calls
    opened, calls = calls_during(conn, lambda: store.open_attempts(conn, "h1"), commit=False)
    assert len(opened) == 3 and all(run.wait_reason is None for run, _ in opened)
    assert "wait_reason" not in calls, calls

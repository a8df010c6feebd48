"""What the submitter's COMMIT costs before its NOTIFY goes out (sql/011_commit_wake_cost.sql, issue 14's
latency): the wake targets of 010 are computed in a deferred trigger, inside the COMMIT, and their costliest
part is asking host_refusal whether the hosts named accept every kind of run submitted. That question is
asked only when its answer can change whom the notification names, never when the hosts named are every
live host with room already. Which hosts are named is tests/integration/test_wake.py's.

Counted, not timed, as tests/integration/test_claim_cost.py counts: pg_stat_xact_user_functions
(track_functions = 'all', which only a superuser may set, hence no run as the bound roles here), with
the deferred trigger fired inside the transaction by SET CONSTRAINTS ALL IMMEDIATE.
"""

from __future__ import annotations

import psycopg

from supervisor import store
from tests.integration.conftest import fleet, wait_notifies


def refusals_asked_at_commit(conn: psycopg.Connection, runs: int) -> int:
    """host_refusal calls made by the commit-time trigger of a transaction that submits `runs` runs
    (committed: its notification goes out)."""
    def calls() -> int:
        return conn.execute("SELECT coalesce(sum(calls), 0) FROM pg_stat_xact_user_functions "
                            "WHERE schemaname = 'unitvisor' AND funcname = 'host_refusal'").fetchone()[0]

    with conn.transaction():
        conn.execute("SET LOCAL track_functions = 'all'")
        conn.execute("SELECT unitvisor.submit_run(ARRAY['/bin/true']) FROM generate_series(1, %s)", (runs,))
        before = calls()
        conn.execute("SET CONSTRAINTS ALL IMMEDIATE")  # the deferred trigger fires here, not at COMMIT
        return calls() - before


def named(spawn_listener: psycopg.Connection) -> frozenset[str] | None:
    [note] = wait_notifies(spawn_listener, timeout=2.0, count=100)
    return store.spawn_hint_targets(note.payload)


def test_a_lone_host_is_named_without_asking_whether_it_accepts(conn: psycopg.Connection, dsn: str,
                                                                 spawn_listener: psycopg.Connection) -> None:
    with fleet(dsn, conn, 1):
        assert refusals_asked_at_commit(conn, 1) == 0
        assert named(spawn_listener) == {"h1"}


def test_a_burst_that_needs_every_host_names_them_without_asking(conn: psycopg.Connection, dsn: str,
                                                                 spawn_listener: psycopg.Connection) -> None:
    with fleet(dsn, conn, 3, max_runs=2):
        assert refusals_asked_at_commit(conn, 10) == 0
        assert named(spawn_listener) == {"h1", "h2", "h3"}


def test_a_submit_that_names_some_of_the_hosts_still_asks(conn: psycopg.Connection, dsn: str,
                                                          spawn_listener: psycopg.Connection) -> None:
    # Two of three hosts are named for one run: whether they accept it decides whether the third is
    # named too, so the question is asked (once: the first host named accepts /bin/true).
    with fleet(dsn, conn, 3):
        assert refusals_asked_at_commit(conn, 1) == 1
        targets = named(spawn_listener)
        assert targets is not None and len(targets) == 2

"""What the submitter's COMMIT costs before its NOTIFY goes out (sql/011_commit_wake_cost.sql, issue 14's
latency): the wake targets of 010 are computed in a deferred trigger, inside the COMMIT, and their costliest
part is asking host_refusal whether the hosts named accept every kind of run submitted. That question is
asked only when its answer can change whom the notification names: never of one or two hosts with room,
all named (011), and of more, once a kind when the first host asked accepts it (038). Which hosts are
named is tests/integration/test_wake.py's.

Counted, not timed, as tests/integration/test_claim_cost.py counts: pg_stat_xact_user_functions
(track_functions = 'all', which only a superuser may set, hence no run as the bound roles here), with
the deferred trigger fired inside the transaction by SET CONSTRAINTS ALL IMMEDIATE.
"""

from __future__ import annotations

import psycopg

from supervisor import store
from tests.integration.conftest import fleet, wait_notifies


def refusals_asked_at_commit(conn: psycopg.Connection, runs: int, argv0: str = "/bin/true") -> int:
    """host_refusal calls made by the commit-time trigger of a transaction that submits `runs` runs
    (committed: its notification goes out)."""
    def calls() -> int:
        return conn.execute("SELECT coalesce(sum(calls), 0) FROM pg_stat_xact_user_functions "
                            "WHERE schemaname = 'unitvisor' AND funcname = 'host_refusal'").fetchone()[0]

    with conn.transaction():
        conn.execute("SET LOCAL track_functions = 'all'")
        conn.execute("SELECT unitvisor.submit_run(ARRAY[%s::text]) FROM generate_series(1, %s)", (argv0, runs))
        before = calls()
        conn.execute("SET CONSTRAINTS ALL IMMEDIATE")  # the deferred trigger fires here, not at COMMIT
        return calls() - before


def named(spawn_listener: psycopg.Connection) -> frozenset[str] | None:
    [note] = wait_notifies(spawn_listener, timeout=2.0, count=100)
    return store.spawn_hint_targets(note.payload)


def test_a_lone_host_is_named_without_asking_whether_it_accepts(conn: psycopg.Connection, dsn: str,
                                                                 spawn_listener: psycopg.Connection) -> None:
    with fleet(dsn, conn, 1, allowed=("/bin/*",)):
        assert refusals_asked_at_commit(conn, 1) == 0
        assert named(spawn_listener) == {"h1"}
        # Even for a run it refuses (038 asks only beyond two hosts with room): waking it for nothing costs
        # one claim, asking would cost every submit.
        assert refusals_asked_at_commit(conn, 1, "/opt/new/tool") == 0
        assert named(spawn_listener) == {"h1"}


def test_a_burst_that_needs_every_host_asks_once_a_kind(conn: psycopg.Connection, dsn: str,
                                                        spawn_listener: psycopg.Connection) -> None:
    # Every host is named already; whether one accepts the kind at all decides whether any is (038): the
    # first host asked accepts /bin/true.
    with fleet(dsn, conn, 3, max_runs=2):
        assert refusals_asked_at_commit(conn, 10) == 1
        assert named(spawn_listener) == {"h1", "h2", "h3"}


def test_a_kind_no_host_accepts_is_asked_of_every_host_with_room(conn: psycopg.Connection, dsn: str,
                                                                  spawn_listener: psycopg.Connection) -> None:
    # Once each: the three hosts with room, two of them named first, none accepting.
    with fleet(dsn, conn, 3, allowed=("/bin/*",)):
        assert refusals_asked_at_commit(conn, 1, "/opt/new/tool") == 3
        assert wait_notifies(spawn_listener, timeout=0.5) == []  # naming nobody: not sent (048)


def test_a_submit_that_names_some_of_the_hosts_still_asks(conn: psycopg.Connection, dsn: str,
                                                          spawn_listener: psycopg.Connection) -> None:
    # Two of three hosts are named for one run: whether they accept it decides whether the third is
    # named too, so the question is asked (once: the first host named accepts /bin/true).
    with fleet(dsn, conn, 3):
        assert refusals_asked_at_commit(conn, 1) == 1
        targets = named(spawn_listener)
        assert targets is not None and len(targets) == 2

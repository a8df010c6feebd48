"""Nothing that cannot start costs a claim (sql/020_claim_gate.sql, issue 23, point 3).

The heartbeat's claimable says no for runs that wait behind a concurrency key, for a not_before, for a
host that refuses them, or while the host has every slot taken; and what it costs, and what a claim
costs, follow the kinds and keys waiting, not the runs. Costs are counted, not timed: the shared
buffers a statement touches (EXPLAIN (ANALYZE, BUFFERS) counts those of the functions it calls too), and
host_refusal's calls (pg_stat_xact_user_functions).

Before 020: 10,000 runs behind one key made claimable true for every host, and the claim that followed
walked all of them (a concurrency_blocker each) to take nothing.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg
import pytest

from supervisor import store, unitspec
from tests.integration.conftest import calls_during, forget_work_marks, register

FMT = unitspec.UNIT_NAME_FORMAT
BEHIND = 3_000  # and 30: a hundred times the runs, the same cost (bench.scale measures 10,000)


def submit(conn: psycopg.Connection, count: int, argv0: str = "/bin/true", **args: Any) -> None:
    names = "".join(f", {name} => %({name})s" for name in args)
    with conn.transaction():
        conn.execute("SET LOCAL statement_timeout = 0")  # thousands of submits in one statement
        conn.execute(f"SELECT unitvisor.submit_run(ARRAY[%(argv0)s::text]{names}) FROM generate_series(1, %(count)s)",
                     {"argv0": argv0, "count": count, **args})


def claimable(conn: psycopg.Connection, fence: store.Fence) -> bool:
    return store.probe(conn, fence, timedelta(seconds=20)).claimable


def buffers(conn: psycopg.Connection, statement: str, params: tuple) -> int:
    """Shared buffers (hit and read) the statement touched, its functions' work included; rolled back.
    After a VACUUM, so that what is counted is the statement's walk, not the dead index entries that the
    test's own bulk claims left behind (autovacuum's work in a fleet).
    The least of five: the first calls of a session also count the planning of the functions' statements
    (catalog pages), which a daemon's session does once."""
    conn.execute("VACUUM unitvisor.spawn_jobs, unitvisor.runs, unitvisor.attempts")
    counts = []
    for _ in range(5):
        with conn.transaction(force_rollback=True):
            plan = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statement, params).fetchone()[0]
        top = plan[0]["Plan"]
        counts.append(top.get("Shared Hit Blocks", 0) + top.get("Shared Read Blocks", 0))
    return min(counts)


def heartbeat_buffers(conn: psycopg.Connection, fence: store.Fence) -> int:
    return buffers(conn, "SELECT * FROM unitvisor.heartbeat(%s, %s, '20 seconds')", (fence.host_id, fence.epoch))


def claim_buffers(conn: psycopg.Connection, fence: store.Fence) -> int:
    return buffers(conn, "SELECT * FROM unitvisor.claim_jobs(%s, %s, 10, %s)", (fence.host_id, fence.epoch, FMT))


def refusal_calls(conn: psycopg.Connection, fence: store.Fence) -> tuple[bool, int]:
    """(claimable, host_refusal calls) of one heartbeat, rolled back."""
    said, calls = calls_during(conn, lambda: claimable(conn, fence), commit=False)
    return said, calls.get("host_refusal", 0)


def claim(conn: psycopg.Connection, fence: store.Fence, batch: int = 10) -> list[str]:
    return [str(row[0]) for row in conn.execute("SELECT run_id FROM unitvisor.claim_jobs(%s, %s, %s, %s)",
                                                (fence.host_id, fence.epoch, batch, FMT)).fetchall()]


def test_runs_behind_one_key_are_no_work_and_cost_the_heartbeat_and_the_claim_nothing_per_run(
        conn: psycopg.Connection, dsn: str) -> None:
    with store.connect(dsn) as other:
        h1 = register(conn, "h1", max_runs=100)
        h2 = register(other, "h2", max_runs=100)
        submit(conn, 1, concurrency_key="k")
        assert claim(conn, h1) and not claim(conn, h1)  # the key's first run is starting on h1
        submit(conn, BEHIND // 100, concurrency_key="k")
        small = heartbeat_buffers(other, h2), claim_buffers(other, h2)
        submit(conn, BEHIND - BEHIND // 100, concurrency_key="k")
        assert not claimable(other, h2)
        assert not claimable(conn, h1)
        large = heartbeat_buffers(other, h2), claim_buffers(other, h2)
        # A hundred times the runs behind the key, about the same index pages (before 020, a page or more per run).
        assert large[0] <= small[0] + 25 and large[0] < 150, (small, large)  # a btree level, not a page per run
        assert large[1] < 250, (small, large)  # before 020, a concurrency_blocker per run: thousands
        # A keyless run among them is found at once, and claimed without walking the key's runs.
        submit(conn, 1)
        assert claimable(other, h2)
        assert len(claim(other, h2)) == 1
        # The key's running run ends: its head is work again, for any host.
        conn.execute("UPDATE unitvisor.runs SET state = 'succeeded', finished_at = now() "
                     "WHERE concurrency_key = 'k' AND state = 'starting'")
        conn.execute("UPDATE unitvisor.attempts SET outcome = 'success', ended_at = now() WHERE host_id = 'h1'")
        forget_work_marks(conn)  # by hand: no run event (test_work_mark.py ends a key's run as the daemon does)
        assert claimable(other, h2)
        assert len(claim(other, h2)) == 1  # one at a time: the head only
        assert not claimable(conn, h1)


def test_runs_no_host_accepts_cost_one_refusal_per_kind(conn: psycopg.Connection) -> None:
    h1 = register(conn, "h1", max_runs=100, allowed=("/bin/*",))
    submit(conn, 1000, argv0="/opt/rollout/new-binary")
    submit(conn, 1000, argv0="/opt/rollout/other-binary")
    said, calls = refusal_calls(conn, h1)
    assert not said
    assert calls <= 2, calls  # one per kind (before 020, of every run: 2,000 calls)
    assert not claim(conn, h1)


def test_runs_not_due_are_no_work(conn: psycopg.Connection) -> None:
    h1 = register(conn, "h1", max_runs=100)
    conn.execute("SELECT unitvisor.submit_run(ARRAY['/bin/true'], not_before => now() + interval '1 hour')")
    assert not claimable(conn, h1)
    conn.execute("UPDATE unitvisor.spawn_jobs SET scheduled_at = now() - interval '1 second'")
    forget_work_marks(conn)  # an hour passed, by hand (test_work_mark.py waits for a due time)
    assert claimable(conn, h1)


def test_a_full_host_has_no_work(conn: psycopg.Connection) -> None:
    h1 = register(conn, "h1", max_runs=2)
    submit(conn, 5)
    assert claimable(conn, h1)
    assert len(claim(conn, h1)) == 2
    assert not claimable(conn, h1)  # three are queued, and h1 has no free slot


@pytest.mark.parametrize("settle", ["outcome", "declared dead", "deleted"])
def test_open_attempts_are_counted_per_host_as_they_open_and_settle(conn: psycopg.Connection, dsn: str,
                                                                    settle: str) -> None:
    def counted() -> dict[str, int]:
        rows = conn.execute("SELECT host_id, open FROM unitvisor.host_open_attempts WHERE open <> 0").fetchall()
        return dict(rows)

    def actual() -> dict[str, int]:
        return dict(conn.execute("SELECT host_id, count(*) FROM unitvisor.attempts WHERE outcome IS NULL "
                                 "GROUP BY host_id").fetchall())

    with store.connect(dsn) as other:
        h1 = register(conn, "h1", max_runs=7)
        h2 = register(other, "h2", max_runs=5)
        submit(conn, 20)
        conn.execute("UPDATE unitvisor.spawn_jobs SET scheduled_at = now() - interval '1 minute'")
        claim(conn, h1)
        claim(other, h2)
        assert counted() == actual() == {"h1": 7, "h2": 5}
        if settle == "outcome":
            conn.execute("UPDATE unitvisor.attempts SET outcome = 'success', ended_at = now() "
                         "WHERE host_id = 'h2' AND attempt = 1 AND run_id IN "
                         "(SELECT run_id FROM unitvisor.attempts WHERE host_id = 'h2' LIMIT 2)")
        elif settle == "declared dead":
            conn.execute("UPDATE unitvisor.attempts SET outcome = 'lost', ended_at = now() WHERE host_id = 'h2'")
        else:
            conn.execute("DELETE FROM unitvisor.attempts WHERE host_id = 'h2'")
        assert counted() == {k: v for k, v in actual().items() if v}
        # The claim reads the counts: h2's free slots are taken by h2 again.
        assert claim(other, h2)
        assert counted() == actual()


def test_past_64_keys_waiting_the_claim_and_the_heartbeat_fall_back_to_asking_each_job(
        conn: psycopg.Connection) -> None:
    # 100 keys, two runs each: the first of each may start, the second waits behind it. Past 64 keys
    # the claim asks concurrency_blocker of each keyed job it fetches (as before 020), and takes the
    # heads only; the heartbeat says "maybe" rather than probe every key.
    h1 = register(conn, "h1", max_runs=1000)
    conn.execute("SELECT unitvisor.submit_run(ARRAY['/bin/true'], concurrency_key => 'k' || (n % 100)) "
                 "FROM generate_series(0, 199) AS n")
    conn.execute("UPDATE unitvisor.spawn_jobs SET scheduled_at = now() - interval '1 minute'")
    assert claimable(conn, h1)
    taken = claim(conn, h1, batch=1000)
    assert len(taken) == 100
    keys = conn.execute("SELECT count(DISTINCT concurrency_key) FROM unitvisor.runs "
                        "WHERE state = 'starting'").fetchone()[0]
    assert keys == 100
    assert not claim(conn, h1, batch=1000)

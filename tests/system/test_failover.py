"""Database failover with runs in flight: a synchronous primary and standby (both throwaway clusters),
the daemon's DSN naming both with target_session_attrs=read-write; the standby is promoted and the
primary stopped. Every run ends recorded exactly once.

Synchronous replication (synchronous_commit=on, the standby in synchronous_standby_names) is what the
drill uses, because it is what a deployment that must not lose a committed claim or outcome in a
failover uses: with asynchronous replication the last commits before the switch may be gone, and
unitvisor would (correctly) run such a run again: at least once, not exactly once.
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from supervisor import store
from tests.harness.host import Host, wait_for
from tests.harness.postgres import Postgres, multi_host_dsn, synchronous_pair
from tests.harness.testbed import Testbed

DB = "unitvisor_failover"


@pytest.fixture
def pair(postgres: Postgres) -> Iterator[tuple[Postgres, Postgres]]:
    # `postgres` only makes this level fail under CI where PostgreSQL is missing; the pair is its own.
    with synchronous_pair() as (primary, standby):
        with store.connect(primary.dsn) as conn:
            conn.execute(f"CREATE DATABASE {DB}")
        with store.connect(primary.dsn_for(DB)) as conn:
            store.migrate(conn)
        yield primary, standby


def test_a_promoted_standby_takes_over_and_nothing_is_lost_or_done_twice(
        testbed: Testbed, pair: tuple[Postgres, Postgres]) -> None:
    primary, standby = pair
    host = Host(testbed, multi_host_dsn(primary, standby, dbname=DB))
    host.reset()
    host.configure()
    try:
        host.start()
        runs = [host.submit("--", *host.gated(f"failover-{n}", exit_code=n)) for n in range(4)]
        wait_for(lambda: all(host.show(r)["state"] == "running" for r in runs), what="runs to be running")
        standby.promote()
        primary.stop_server()
        host.open_gate(*(f"failover-{n}" for n in range(4)))  # they end while the daemon reconnects
        after = host.submit("--", "/bin/true")  # through the same DSN, now to the new primary
        results = {run_id: host.wait_run(run_id, timeout=120) for run_id in runs + [after]}
        for n, run_id in enumerate(runs):
            [attempt] = results[run_id]["attempts"]
            assert attempt["exit_status"] == f"exit:{n}", results[run_id]
        assert results[after]["state"] == "succeeded"
        with psycopg.connect(standby.dsn_for(DB), autocommit=True) as conn:
            counts = conn.execute(
                """SELECT run_id, state, count(*) FROM unitvisor.run_events
                   WHERE state IN ('starting', 'running', 'succeeded', 'failed')
                   GROUP BY run_id, state HAVING count(*) <> 1""").fetchall()
            assert counts == [], f"events recorded more than once: {counts}"
            assert conn.execute("SELECT count(*) FROM unitvisor.attempts").fetchone()[0] == 5
        assert "database-connected" in host.daemon_log()
    finally:
        host.reset()

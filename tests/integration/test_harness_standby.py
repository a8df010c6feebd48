"""The streaming standby of tests/harness/postgres.py: a synchronous pair, a failover by promotion,
and a multi-host DSN that finds the new primary."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import psycopg
import pytest

from tests.harness.host import wait_for
from tests.harness.postgres import Postgres, multi_host_dsn, synchronous_pair


@pytest.fixture
def pair(postgres: Postgres) -> Iterator[tuple[Postgres, Postgres]]:
    # `postgres` only makes this level fail under CI where PostgreSQL is missing; the pair is its own.
    with synchronous_pair() as (primary, standby):
        yield primary, standby
    assert not primary.dir.exists() and not standby.dir.exists()


def rows(conn: psycopg.Connection) -> list[str]:
    return [r[0] for r in conn.execute("SELECT note FROM claims ORDER BY id")]


def test_failover_to_the_synchronous_standby(pair: tuple[Postgres, Postgres]) -> None:
    primary, standby = pair
    with primary.connect() as conn:
        assert conn.execute("SHOW synchronous_commit").fetchone() == ("on",)
        assert conn.execute("SHOW synchronous_standby_names").fetchone() == (standby.application_name,)
        assert conn.execute("SELECT sync_state FROM pg_stat_replication").fetchall() == [("sync",)]
        conn.execute("CREATE TABLE claims (id serial PRIMARY KEY, note text)")
        conn.execute("INSERT INTO claims (note) VALUES ('before')")
    with standby.connect() as conn:
        assert conn.execute("SELECT pg_is_in_recovery()").fetchone() == (True,)
        wait_for(lambda: conn.execute("SELECT to_regclass('claims')").fetchone()[0] and rows(conn) == ["before"],
                 timeout=10, what="the row to be replayed on the standby")
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            conn.execute("INSERT INTO claims (note) VALUES ('no')")

    dsn = multi_host_dsn(primary, standby)
    assert dsn.startswith(f"host=127.0.0.1,127.0.0.1 port={primary.port},{standby.port} ")
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.info.port == primary.port

    standby.promote()
    assert not standby.in_recovery()
    primary.stop_server()
    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
        assert conn.info.port == standby.port
        assert rows(conn) == ["before"]
        conn.execute("INSERT INTO claims (note) VALUES ('after')")
        assert rows(conn) == ["before", "after"]


def test_a_commit_acknowledged_before_the_primary_crashes_is_on_the_standby(pair: tuple[Postgres, Postgres]) -> None:
    primary, standby = pair
    with primary.connect() as conn:
        conn.execute("CREATE TABLE claims (id serial PRIMARY KEY, note text)")
        for n in range(50):
            conn.execute("INSERT INTO claims (note) VALUES (%s)", (f"claim {n}",))
    primary.stop_server(mode="immediate")  # a crash, the instant after the last acknowledgement
    standby.promote()
    with psycopg.connect(multi_host_dsn(primary, standby), autocommit=True, connect_timeout=5) as conn:
        assert rows(conn) == [f"claim {n}" for n in range(50)]


def test_after_promotion_the_old_primary_blocks_commits(pair: tuple[Postgres, Postgres]) -> None:
    """Why the drills stop the old primary: its synchronous standby is gone, so COMMIT waits (and
    statement_timeout does not end that wait: it is disarmed before the commit). A cancelled wait even
    reports success, with a WARNING, for a row the new primary lacks."""
    primary, standby = pair
    with primary.connect() as conn:
        conn.execute("CREATE TABLE claims (id serial PRIMARY KEY, note text)")
    standby.promote()
    notices: list[str] = []
    with primary.connect() as conn, primary.connect() as other:
        conn.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))
        conn.execute("SET statement_timeout = '200ms'")
        canceller = threading.Timer(1.0, other.execute, ("SELECT pg_cancel_backend(%s)", (conn.info.backend_pid,)))
        canceller.start()
        started = time.monotonic()
        try:
            conn.execute("INSERT INTO claims (note) VALUES ('split brain')")
        finally:
            canceller.join()
        assert time.monotonic() - started >= 0.9  # it waited for the cancel, not the statement_timeout
        assert rows(conn) == ["split brain"]
    assert any("synchronous replication" in n for n in notices), notices
    with standby.connect() as conn:
        assert rows(conn) == []


def test_a_default_primary_is_made_synchronous_and_a_later_standby_does_not_inherit_that(postgres: Postgres) -> None:
    primary = Postgres()  # synchronous_commit=off, as every harness cluster: make_standby restarts it
    standbys: list[Postgres] = []
    try:
        primary.init()
        primary.start()
        standbys.append(primary.make_standby(synchronous=True))
        standbys.append(primary.make_standby(synchronous=False, name="async1"))
        with primary.connect() as conn:
            assert conn.execute("SHOW synchronous_commit").fetchone() == ("on",)
            assert conn.execute("SHOW synchronous_standby_names").fetchone() == ("standby1",)
            assert conn.execute("SELECT application_name, sync_state FROM pg_stat_replication ORDER BY 1").fetchall() \
                == [("async1", "async"), ("standby1", "sync")]
        # async1's copy of the primary's settings named standby1 as its synchronous standby: promoted,
        # it would wait for it on every commit, had make_standby not removed that.
        standbys[1].promote()
        with standbys[1].connect() as conn:
            assert conn.execute("SHOW synchronous_standby_names").fetchone() == ("",)  # else the next line hangs
            conn.execute("CREATE TABLE t (x int)")
    finally:
        for standby in standbys:
            standby.stop()
        primary.stop()

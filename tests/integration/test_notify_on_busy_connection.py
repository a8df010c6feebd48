"""The daemon's one connection both queries and LISTENs (supervisor/daemon.py). A NOTIFY committed while
a query runs on it reaches the client inside that query's answer, where psycopg (3.1 and the newest)
reads it, takes it out of libpq's queue and hands it to the handlers registered with
add_notify_handler: the daemon's handler is the only place it can be seen. Real PostgreSQL, no mocks."""

from __future__ import annotations

import threading

import psycopg

from supervisor import store
from supervisor.daemon import STALL_AFTER
from supervisor.guard import Guard, GuardedConnection
from tests.harness.host import wait_for

LOCK_KEY = 0x6F6E65636F6E6E  # any key: the other session holds it while the query waits for it


def test_a_notify_sent_while_a_query_runs_reaches_the_handler(dsn: str) -> None:
    heard: list[psycopg.Notify] = []
    with store.connect(dsn, GuardedConnection) as conn, store.connect(dsn) as other:
        conn.guard = Guard(STALL_AFTER, None, list)  # as the daemon's: every wait goes through it
        conn.add_notify_handler(heard.append)
        store.listen(conn, store.SPAWN_CHANNEL, store.CANCEL_CHANNEL)
        query_pid = conn.info.backend_pid
        with other.transaction():
            other.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY,))
            other.execute("SELECT pg_notify(%s, 'while the query runs')", (store.SPAWN_CHANNEL,))
            # The query blocks on the lock the other session holds, so the NOTIFY commits while it runs.
            query = threading.Thread(target=conn.execute, args=("SELECT pg_advisory_lock(%s), pg_advisory_unlock(%s)",
                                                                (LOCK_KEY, LOCK_KEY)))
            query.start()
            with store.connect(dsn) as observer:
                wait_for(lambda: observer.execute("SELECT wait_event_type = 'Lock' FROM pg_stat_activity "
                                                  "WHERE pid = %s", (query_pid,)).fetchone()[0],
                         what="the query to wait for the lock")
        query.join(timeout=30)
        assert not query.is_alive()
        assert [(n.channel, n.payload) for n in heard] == [(store.SPAWN_CHANNEL, "while the query runs")]
        # Read by psycopg inside the query: nothing is left for the loop's own read of libpq's queue.
        conn.pgconn.consume_input()
        assert conn.pgconn.notifies() is None
        # And the connection is fit for the next statement.
        assert conn.execute("SELECT 1").fetchone() == (1,)

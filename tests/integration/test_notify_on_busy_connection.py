"""The daemon's one connection both queries and LISTENs (supervisor/daemon.py). A NOTIFY committed while
a query runs on it reaches the client inside that query's answer, where psycopg (3.1 and the newest)
reads it, takes it out of libpq's queue and hands it to the handlers registered with
add_notify_handler: the daemon's handler is the only place it can be seen. Real PostgreSQL, no mocks.

The order is made certain, not left to timing. PostgreSQL (15+) sends the notifications a backend was
signalled about during a transaction just before that transaction's ReadyForQuery. The NOTIFY is
committed by a third session while the query is blocked on a lock, and its COMMIT returns only after
the listening backend was signalled; the lock is released only then. Releasing the lock in the same
transaction as the NOTIFY (as this test once did) races: the query can finish and answer before the
signal lands, and the notification then arrives after the answer, on the idle socket, where the loop's
own read takes it."""

from __future__ import annotations

import threading

import psycopg

from supervisor import store
from supervisor.daemon import STALL_AFTER
from supervisor.guard import Guard, GuardedConnection
from tests.harness.host import wait_for

LOCK_KEY = 0x6F6E65636F6E6E  # any key: the holder session keeps it while the query waits for it


def test_a_notify_sent_while_a_query_runs_reaches_the_handler(dsn: str) -> None:
    heard: list[psycopg.Notify] = []
    with store.connect(dsn, GuardedConnection) as conn, store.connect(dsn) as holder, \
            store.connect(dsn) as notifier, store.connect(dsn) as observer:
        conn.guard = Guard(STALL_AFTER)  # as the daemon's: every wait goes through it
        conn.add_notify_handler(heard.append)
        store.listen(conn, store.SPAWN_CHANNEL, store.CANCEL_CHANNEL)
        query_pid = conn.info.backend_pid
        with holder.transaction():
            holder.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY,))
            query = threading.Thread(target=conn.execute, args=("SELECT pg_advisory_lock(%s), pg_advisory_unlock(%s)",
                                                                (LOCK_KEY, LOCK_KEY)))
            query.start()
            wait_for(lambda: observer.execute("SELECT wait_event_type = 'Lock' FROM pg_stat_activity "
                                              "WHERE pid = %s", (query_pid,)).fetchone()[0],
                     what="the query to wait for the lock")
            # Autocommit: this returns once the NOTIFY committed and the listening backend was signalled.
            notifier.execute("SELECT pg_notify(%s, 'while the query runs')", (store.SPAWN_CHANNEL,))
        query.join(timeout=30)
        assert not query.is_alive()
        assert [(n.channel, n.payload) for n in heard] == [(store.SPAWN_CHANNEL, "while the query runs")]
        # Read by psycopg inside the query: nothing is left for the loop's own read of libpq's queue.
        conn.pgconn.consume_input()
        assert conn.pgconn.notifies() is None
        # And the connection is fit for the next statement.
        assert conn.execute("SELECT 1").fetchone() == (1,)

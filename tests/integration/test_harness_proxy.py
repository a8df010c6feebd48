"""The partition proxy of tests/harness/proxy.py, against a real PostgreSQL: forwarding, a reset, a
black hole, and healing."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import psycopg
import pytest

from tests.harness.host import wait_for
from tests.harness.postgres import Postgres
from tests.harness.proxy import Proxy


@pytest.fixture
def proxy(postgres: Postgres) -> Iterator[Proxy]:
    with Proxy(target_port=postgres.port) as p:
        yield p
    assert not p._thread.is_alive(), "the proxy's thread outlived close()"
    assert p.errors == []


def connect(proxy: Proxy, timeout: int = 5) -> psycopg.Connection:
    return psycopg.connect(proxy.dsn(), connect_timeout=timeout, autocommit=True)


def backends_from(postgres: Postgres, app: str) -> int:
    with psycopg.connect(postgres.dsn, autocommit=True) as conn:
        return conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (app,)).fetchone()[0]


def test_forwards_queries_and_counts_connections(proxy: Proxy) -> None:
    with connect(proxy) as a, connect(proxy) as b:
        assert a.execute("SELECT 1").fetchone() == (1,)
        assert b.execute("SELECT inet_server_port()").fetchone() == (proxy.target[1],)
        assert proxy.connections == 2
    wait_for(lambda: proxy.connections == 0, timeout=5, what="the proxy to see both clients leave")


def test_reset_breaks_open_connections_and_refuses_new_ones_then_heals(proxy: Proxy, postgres: Postgres) -> None:
    conn = psycopg.connect(proxy.dsn(), connect_timeout=5, autocommit=True, application_name="proxy-reset")
    assert conn.execute("SELECT 1").fetchone() == (1,)
    proxy.cut("reset")
    assert proxy.connections == 0
    started = time.monotonic()
    with pytest.raises(psycopg.OperationalError):
        conn.execute("SELECT 1")
    assert time.monotonic() - started < 1
    conn.close()
    # The server's side was reset too: its backend goes away without waiting for a timeout.
    wait_for(lambda: backends_from(postgres, "proxy-reset") == 0, timeout=5, what="the backend to end")
    started = time.monotonic()
    with pytest.raises(psycopg.OperationalError):
        connect(proxy, timeout=10)
    assert time.monotonic() - started < 1
    proxy.heal()
    with connect(proxy) as again:
        assert again.execute("SELECT 2").fetchone() == (2,)


def test_blackhole_hangs_queries_and_connects_until_healed(proxy: Proxy) -> None:
    conn = connect(proxy)
    assert conn.execute("SELECT 1").fetchone() == (1,)
    proxy.cut("blackhole")
    assert proxy.connections == 1  # still open: nothing tells the client
    outcome: list[BaseException | tuple] = []

    def query() -> None:
        try:
            outcome.append(conn.execute("SELECT 42").fetchone())
        except BaseException as exc:  # handed to the test thread
            outcome.append(exc)

    thread = threading.Thread(target=query, daemon=True)
    thread.start()
    thread.join(timeout=2)
    assert thread.is_alive() and not outcome, f"a query got through the black hole: {outcome}"

    started = time.monotonic()
    with pytest.raises(psycopg.OperationalError):
        connect(proxy, timeout=2)  # the TCP connect succeeds; the server's answer never comes
    assert 1.5 < time.monotonic() - started < 5

    proxy.heal()  # closes the black-holed connection: the hung query fails at once
    thread.join(timeout=3)
    assert not thread.is_alive(), "the hung query was not freed by heal()"
    assert len(outcome) == 1 and isinstance(outcome[0], psycopg.OperationalError), outcome
    conn.close()
    with connect(proxy) as again:
        assert again.execute("SELECT 3").fetchone() == (3,)
    assert proxy.mode == "forward"


def test_close_resets_what_is_open_and_is_idempotent(postgres: Postgres) -> None:
    proxy = Proxy(target_port=postgres.port)
    conn = connect(proxy)
    proxy.close()
    proxy.close()
    assert not proxy._thread.is_alive() and proxy.connections == 0
    with pytest.raises(psycopg.OperationalError):
        conn.execute("SELECT 1")
    conn.close()
    with pytest.raises(RuntimeError):
        proxy.cut("reset")


def test_a_target_that_is_down_looks_like_a_refused_connect() -> None:
    from tests.harness.postgres import free_port

    with Proxy(target_port=free_port()) as proxy:
        started = time.monotonic()
        with pytest.raises(psycopg.OperationalError):
            connect(proxy, timeout=10)
        assert time.monotonic() - started < 1
        assert proxy.errors == []

"""A host named in a submit's notification is told on a channel of its own (sql/migrations/
048_named_hosts_told_alone.sql, issue 23): no other daemon wakes for a job that names a few hosts. Which
hosts a submit names is tests/integration/test_wake.py's; what the daemon does with what it hears,
tests/unit/test_daemon_loop.py's."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import psycopg
import pytest

from supervisor import store, unitspec
from tests.integration.conftest import Note, fence_of, register, wait_notifies

pytestmark = pytest.mark.usefixtures("as_bound_roles")


@contextlib.contextmanager
def hosts(dsn: str, conn: psycopg.Connection, *alone: bool, **profile: object) -> Iterator[list[psycopg.Connection]]:
    """Hosts h1..hN, each on a connection of its own (not `conn`, which submits: psycopg takes a session's
    own notifications while its statement runs); those marked True registered as a daemon of this release
    does (its own channel, in the registration's transaction), the others as one of 0.11.0."""
    with contextlib.ExitStack() as stack:
        conns = [stack.enter_context(store.connect(dsn)) for _ in alone]
        for i, (c, own) in enumerate(zip(conns, alone, strict=True), 1):
            store.listen(c, store.SPAWN_CHANNEL)
            with c.transaction():
                fence = register(c, f"h{i}", **profile)
                if own:
                    store.register_wake_channel(c, fence)
        yield conns


def notes(conn: psycopg.Connection, timeout: float = 1.0) -> list[Note]:
    return wait_notifies(conn, timeout=timeout, count=100)


def own_channel(conn: psycopg.Connection, host: str) -> str:
    return conn.execute("SELECT unitvisor.host_wake_channel(%s)", (host,)).fetchone()[0]


def test_a_pinned_run_is_told_to_its_host_alone(conn: psycopg.Connection, dsn: str,
                                               spawn_listener: psycopg.Connection) -> None:
    with hosts(dsn, conn, True, True, True) as conns:
        notes(conns[0], timeout=0.2)  # what the registrations sent
        store.submit_run(conn, argv=["/bin/true"], host_pin="h2")
        assert notes(conns[1]) == [Note(own_channel(conn, "h2"), "")]
        assert notes(spawn_listener, timeout=0.3) == []
        assert notes(conns[2], timeout=0.1) == [] and notes(conns[0], timeout=0.1) == []


def test_hosts_of_0_11_0_are_told_on_the_shared_channel_naming_them_alone(
        conn: psycopg.Connection, dsn: str, spawn_listener: psycopg.Connection) -> None:
    # Two hosts with room: both are named (011), the new one on its channel, the old one as before.
    with hosts(dsn, conn, True, False) as conns:
        store.submit_run(conn, argv=["/bin/true"])
        [shared] = notes(spawn_listener)
        assert shared.channel == store.SPAWN_CHANNEL and store.spawn_hint_targets(shared.payload) == {"h2"}
        # h1 hears both (its daemon drops the shared one, which does not name it).
        assert sorted(notes(conns[0]), key=str) == sorted([Note(own_channel(conn, "h1"), ""), shared], key=str)


def test_a_registration_without_the_channel_voids_it(conn: psycopg.Connection, dsn: str,
                                                      spawn_listener: psycopg.Connection) -> None:
    # A downgrade: the daemon of 0.11.0 on the same host registers without saying it listens alone (its
    # session does not), and is told on the shared channel again.
    with hosts(dsn, conn, True) as conns:
        register(conns[0], "h1")
        store.submit_run(conn, argv=["/bin/true"], host_pin="h1")
        [shared] = notes(spawn_listener)
        assert store.spawn_hint_targets(shared.payload) == {"h1"}


def test_more_than_16_named_are_told_in_one_shared_notification(conn: psycopg.Connection, dsn: str,
                                                                 spawn_listener: psycopg.Connection) -> None:
    with hosts(dsn, conn, True, True) as conns:
        with conn.transaction():
            for i in range(1, 18):
                store.submit_run(conn, argv=["/bin/true"], host_pin=f"h{i}")
        [shared] = notes(spawn_listener)
        assert store.spawn_hint_targets(shared.payload) == {f"h{i}" for i in range(1, 18)}
        assert notes(conns[1], timeout=0.2) == [shared]  # the shared one only


def test_a_notification_naming_nobody_is_not_sent(conn: psycopg.Connection, dsn: str,
                                                  spawn_listener: psycopg.Connection) -> None:
    # Three hosts with room, so that they are asked (011); none accepts the run (038).
    with hosts(dsn, conn, True, False, True, allowed=("/bin/*",)) as conns:
        store.submit_run(conn, argv=["/opt/new/tool"])
        assert notes(spawn_listener) == []
        assert all(notes(c, timeout=0.1) == [] for c in conns)


def test_the_channel_is_a_short_name_of_the_id(conn: psycopg.Connection, dsn: str) -> None:
    # Any id up to the daemon's 255 characters (config.HOST_ID_MAX) makes a channel PostgreSQL accepts
    # (at most 63 bytes); distinct ids, distinct channels.
    long_id = "ħ" * 255
    channels = {own_channel(conn, host) for host in ("h1", "h2", long_id, "x y\\'\"")}
    assert len(channels) == 4 and all(c.startswith("unitvisor_spawn_") and len(c) <= 63 for c in channels)
    with store.connect(dsn) as listener:
        store.listen(listener, own_channel(conn, long_id))
        conn.execute("SELECT pg_notify(%s, '')", (own_channel(conn, long_id),))
        assert [n.channel for n in notes(listener)] == [own_channel(conn, long_id)]


def running_on(host_conn: psycopg.Connection, host: str, conn: psycopg.Connection) -> str:
    """A run submitted on `conn`, claimed and started by `host` on its own connection: its id."""
    run_id = store.submit_run(conn, argv=["/bin/true"], host_pin=host)
    fence = fence_of(conn, host)
    [(_, attempt)] = store.claim(host_conn, fence, 1, unitspec.UNIT_NAME_FORMAT)
    store.mark_started(host_conn, fence, attempt, "inv", None)
    notes(host_conn, timeout=0.2)
    return str(run_id)


@pytest.fixture
def cancel_listener(dsn: str) -> Iterator[psycopg.Connection]:
    with store.connect(dsn) as listener:
        store.listen(listener, store.CANCEL_CHANNEL)
        yield listener


def test_a_cancel_is_told_to_the_runs_host_alone(conn: psycopg.Connection, dsn: str,
                                                cancel_listener: psycopg.Connection) -> None:
    with hosts(dsn, conn, True, True) as conns:
        for c in conns:
            store.listen(c, store.CANCEL_CHANNEL)
        run_id = running_on(conns[0], "h1", conn)
        assert store.cancel_run(conn, run_id) == store.Transition("running", True)
        assert notes(conns[0]) == [Note(own_channel(conn, "h1"), store.OWN_CHANNEL_REQUEST)]
        assert notes(cancel_listener, timeout=0.3) == [] and notes(conns[1], timeout=0.1) == []
        # A freeze request too: the same channel, read by the same pass of the daemon (freezer.py).
        run_id = running_on(conns[0], "h1", conn)
        assert store.freeze_run(conn, run_id).changed
        assert notes(conns[0]) == [Note(own_channel(conn, "h1"), store.OWN_CHANNEL_REQUEST)]
        assert notes(cancel_listener, timeout=0.3) == []


def test_a_cancel_for_a_host_of_0_11_0_is_told_to_every_daemon(conn: psycopg.Connection, dsn: str,
                                                              cancel_listener: psycopg.Connection) -> None:
    with hosts(dsn, conn, False) as conns:
        run_id = running_on(conns[0], "h1", conn)
        store.cancel_run(conn, run_id)
        assert notes(cancel_listener) == [Note(store.CANCEL_CHANNEL, run_id)]


def test_a_queued_runs_cancel_is_told_to_nobody(conn: psycopg.Connection, dsn: str,
                                               cancel_listener: psycopg.Connection) -> None:
    # Cancelled at once, with its job: no daemon has anything to do for it.
    with hosts(dsn, conn, True) as conns:
        run_id = store.submit_run(conn, argv=["/bin/true"], host_pin="h1")
        notes(conns[0], timeout=0.3)
        assert store.cancel_run(conn, run_id) == store.Transition("cancelled", True)
        assert notes(cancel_listener, timeout=0.3) == [] and notes(conns[0], timeout=0.1) == []


def test_registering_the_channel_is_fenced(conn: psycopg.Connection, dsn: str) -> None:
    with hosts(dsn, conn, False) as conns:
        with pytest.raises(psycopg.Error, match="fenced"):
            store.register_wake_channel(conns[0], store.Fence("h1", 0))

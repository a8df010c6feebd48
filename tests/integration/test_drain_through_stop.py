"""A drained host that stops stays drained and is not declared dead (issue 24; schema 24, drain_through_stop).

Before 024 a drained host's clean stop left it 'draining' (mark_host_stopped stopped only an active host,
so that a restart kept the drain), and a live peer declared it dead once it had been silent for its
host_dead_after: the host-declared-dead alert for a planned stop. Now it is 'stopped' and keeps its drain
in hosts.left_draining: it comes back draining, and claims nothing until undrain."""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
import pytest

from supervisor import store, unitspec
from tests.integration.conftest import age_jobs, backend_gone, connected, host_profile, register, silence
from tests.integration.test_migrate_operations import sql_dir_up_to


def host(conn: psycopg.Connection, host_id: str) -> tuple[str, bool]:
    return conn.execute("SELECT state, left_draining FROM unitvisor.hosts WHERE id = %s", (host_id,)).fetchone()


def declared(conn: psycopg.Connection, declarer: store.Fence) -> list[str]:
    """The hosts a live peer, connected for an hour, declares dead now."""
    connected(conn, declarer.host_id)
    return [d.host_id for d in store.declare_dead(conn, declarer, 3600, 5).dead]


@pytest.fixture
def peer(conn: psycopg.Connection) -> store.Fence:
    return register(conn, "peer")


def test_a_drained_host_stops_drained_is_not_declared_dead_and_comes_back_draining(
        conn: psycopg.Connection, dsn: str, peer: store.Fence) -> None:
    """Failed before 024: mark_host_stopped left it ('draining', ...), and the peer declared it dead."""
    with store.connect(dsn) as web:
        fence = register(web, "web-1")
        assert store.set_host_state(conn, "web-1", "draining") == "active"
        store.mark_host_stopped(web, fence)
        pid = web.info.backend_pid
    backend_gone(conn, pid)  # its session's host lock is released before the daemon registers again, below
    assert host(conn, "web-1") == ("stopped", True)
    silence(conn, "web-1", 600)  # ten times its host_dead_after
    assert declared(conn, peer) == []
    assert host(conn, "web-1") == ("stopped", True)
    hosts = {r["id"]: r for r in store.list_hosts(conn)}
    assert hosts["web-1"]["comes_back_draining"] and not hosts["peer"]["comes_back_draining"]

    # Its daemon starts again: draining, and it claims nothing until undrain.
    store.submit_run(conn, argv=["/bin/true"], host_pin="web-1")
    age_jobs(conn)
    with store.connect(dsn) as web:
        again = store.register_host(web, host_profile("web-1"))
        assert (again.state, again.epoch) == ("draining", fence.epoch)
        assert host(conn, "web-1") == ("draining", False)
        assert store.claim(web, fence, 10, unitspec.UNIT_NAME_FORMAT) == []
        assert store.set_host_state(conn, "web-1", "active") == "draining"
        assert len(store.claim(web, fence, 10, unitspec.UNIT_NAME_FORMAT)) == 1


def test_an_undrained_host_stops_and_comes_back_active(conn: psycopg.Connection, peer: store.Fence) -> None:
    fence = register(conn, "web-1")
    store.mark_host_stopped(conn, fence)
    assert host(conn, "web-1") == ("stopped", False)
    silence(conn, "web-1", 600)
    assert declared(conn, peer) == []
    assert store.register_host(conn, host_profile("web-1")).state == "active"


def test_draining_a_stopped_host_keeps_it_stopped_and_its_start_drained(conn: psycopg.Connection,
                                                                         peer: store.Fence) -> None:
    """Failed before 024: set_host_state made the silent host 'draining' (or 'active'), overdue, and the
    peer declared it dead."""
    fence = register(conn, "web-1")
    store.mark_host_stopped(conn, fence)
    silence(conn, "web-1", 600)
    assert store.set_host_state(conn, "web-1", "draining") == "stopped"
    assert host(conn, "web-1") == ("stopped", True)
    assert store.set_host_state(conn, "web-1", "draining") == "stopped (drained)"
    assert declared(conn, peer) == []
    assert store.set_host_state(conn, "web-1", "active") == "stopped (drained)"
    assert host(conn, "web-1") == ("stopped", False)
    assert declared(conn, peer) == []
    assert store.set_host_state(conn, "web-1", "draining") == "stopped"
    assert store.register_host(conn, host_profile("web-1")).state == "draining"


def test_a_drained_host_stopped_with_a_run_open_is_declared_dead_and_comes_back_draining(
        conn: psycopg.Connection, dsn: str, peer: store.Fence) -> None:
    """Its open attempt must be settled by someone: as any stopped host with runs open, it is declared dead
    after its host_dead_after; the drain outlives that too."""
    store.submit_run(conn, argv=["/bin/true"], host_pin="web-1")
    age_jobs(conn)
    with store.connect(dsn) as web:
        fence = register(web, "web-1")
        assert len(store.claim(web, fence, 10, unitspec.UNIT_NAME_FORMAT)) == 1
        store.set_host_state(web, "web-1", "draining")
        store.mark_host_stopped(web, fence)
        pid = web.info.backend_pid
    backend_gone(conn, pid)  # its session's host lock is released (the register below would be refused)
    silence(conn, "web-1", 600)
    assert declared(conn, peer) == ["web-1"]
    assert host(conn, "web-1") == ("dead", True)
    assert store.register_host(conn, host_profile("web-1")).state == "draining"


def test_forget_takes_a_drained_stopped_host_at_once(conn: psycopg.Connection) -> None:
    fence = register(conn, "web-1")
    store.set_host_state(conn, "web-1", "draining")
    store.mark_host_stopped(conn, fence)
    assert store.retire_host(conn, "web-1") == store.Forgotten("stopped", 0)


def test_the_migration_stops_a_draining_host_whose_daemon_is_gone(empty_dsn: str, tmp_path: Path) -> None:
    """A host stopped while draining under 023's functions is still 'draining': 024 makes it stopped with
    its drain kept, and leaves a draining host whose daemon holds its host lock (it is connected) alone."""
    with store.connect(empty_dsn) as conn, store.connect(empty_dsn) as live:
        store.migrate(conn, sql_dir_up_to(tmp_path, 23), from_schema=False)
        for host_id in ("gone", "live", "recent"):
            conn.execute("INSERT INTO unitvisor.hosts (id, name, max_runs, state, poll_interval_sec) "
                         "VALUES (%s, %s, 1, 'draining', 10)", (host_id, host_id))
        silence(conn, "gone", 21)
        silence(conn, "live", 21)
        live.execute("SELECT pg_advisory_lock(unitvisor.host_lock_key('live'))")
        applied = store.migrate(conn)
        assert applied[0] == "024_drain_through_stop" and all(version > "024" for version in applied[1:])
        states = dict(conn.execute("SELECT id, state || ' ' || left_draining FROM unitvisor.hosts").fetchall())
    assert states == {"gone": "stopped true", "live": "draining false", "recent": "draining false"}


def test_drain_and_undrain_of_a_stopped_host_say_what_it_comes_back_as(cli, dsn: str,
                                                                         conn: psycopg.Connection) -> None:
    store.mark_host_stopped(conn, register(conn, "web-1"))
    comes_back = "its daemon comes back {} when it starts\n"
    drained = cli("drain", "web-1", dsn=dsn)
    assert drained.stdout == "host web-1: stopped -> stopped (drained): " + comes_back.format("draining")
    assert cli("drain", "web-1", dsn=dsn).stdout == ("host web-1 is already stopped (drained): "
                                                     + comes_back.format("draining"))
    [row] = json.loads(cli("hosts", "--json", dsn=dsn).stdout)
    assert (row["state"], row["display_state"], row["comes_back_draining"]) == ("stopped", "stopped (drained)", True)
    assert "stopped (drained)" in cli("hosts", dsn=dsn).stdout
    undrained = cli("undrain", "web-1", dsn=dsn)
    assert undrained.stdout == "host web-1: stopped (drained) -> stopped: " + comes_back.format("active")

"""An idle heartbeat costs the same on a fleet of 10 hosts and of 200 (sql/migrations/029_heartbeat_cost.sql, issue 23,
point 4: the idle fleet's server CPU per host per minute grew with the number of hosts).

Each heartbeat looks for a silent host (the upkeep flag), which walks every host row. Before 029,
host_is_overdue held a subquery, so the planner could not inline it: the walk called it once per other
host, a function call each (1.4 ms a heartbeat at 100 hosts, 22 ms at 1,000, on the loaded 2-core
machine). Counted, not timed: the SQL functions a heartbeat calls (pg_stat_xact_user_functions counts
every call of a function that is not inlined). Before 029 this test saw 9 and 199 calls of
host_is_overdue.
"""

from __future__ import annotations

from datetime import timedelta

import psycopg

from supervisor import store
from tests.integration.conftest import calls_during, fence_of, look_again, register, silence


def function_calls(conn: psycopg.Connection, fence: store.Fence) -> tuple[store.Probe, dict[str, int]]:
    """One heartbeat, rolled back: its answer, and the calls of each unitvisor function it made."""
    return calls_during(conn, lambda: store.probe(conn, fence, timedelta(seconds=20)), commit=False)


def add_hosts(conn: psycopg.Connection, first: int, last: int) -> None:
    for i in range(first, last):
        register(conn, f"peer-{i:03d}")


def test_an_idle_heartbeat_makes_the_same_calls_whatever_the_fleet(conn: psycopg.Connection) -> None:
    me = register(conn, "me")
    add_hosts(conn, 0, 9)
    small_probe, small = function_calls(conn, me)
    add_hosts(conn, 9, 199)
    large_probe, large = function_calls(conn, me)
    assert small_probe.upkeep is False and large_probe.upkeep is False  # nobody is silent
    assert large == small, (small, large)  # before 029: host_is_overdue 9 calls, then 199
    assert "host_is_overdue" not in large  # inlined: a few comparisons a host row
    # A silent host is still seen, by every heartbeat.
    silence(conn, "peer-150", 1000)
    silent_probe, calls = function_calls(conn, me)
    assert silent_probe.upkeep is True
    assert calls.get("host_has_open_attempt", 0) == 0  # asked of a stopped host only


def test_only_a_heartbeat_that_could_get_the_fleets_turn_says_upkeep(conn: psycopg.Connection, dsn: str) -> None:
    """Before 029 every host's heartbeat said "upkeep" while a job waited, and every daemon asked for the
    turn each poll interval (12.5 statements per host per minute at 300 hosts, 7.0 idle); one got it."""
    with store.connect(dsn) as other:
        h1 = register(conn, "h1", allowed=("/bin/*",))
        h2 = register(other, "h2", allowed=("/bin/*",))
        conn.execute("SELECT unitvisor.submit_run(ARRAY['/opt/rollout/new-binary'])")  # no host accepts it
        waited = timedelta(0)
        assert store.probe(conn, h1, waited).upkeep is True
        assert store.probe(other, h2, waited).upkeep is True  # nobody has had the turn yet
        assert store.fleet_upkeep_turn(conn, h1, timedelta(seconds=10)) is True
        assert store.probe(other, h2, waited).upkeep is False  # h1 has this interval's (before 029: True)
        assert store.probe(conn, h1, waited).upkeep is False
        # A poll interval (each host's own, 10 s) after the turn was given, the next heartbeat is told again.
        conn.execute("UPDATE unitvisor.fleet_upkeep SET turn_at = now() - interval '11 seconds'")
        assert store.probe(other, h2, waited).upkeep is True
        assert store.fleet_upkeep_turn(other, h2, timedelta(seconds=10)) is True


def host_scans(conn: psycopg.Connection, fence: store.Fence) -> tuple[store.Probe, int]:
    """One heartbeat, committed (its stamp is what the next one reads): its answer, and how many times it
    walked the host rows (the look for a silent host: no index answers it)."""
    with conn.transaction():
        query = "SELECT seq_scan FROM pg_stat_xact_user_tables WHERE schemaname = 'unitvisor' AND relname = 'hosts'"
        before = conn.execute(query).fetchone()[0]
        probe = store.probe(conn, fence, timedelta(seconds=20))
        return probe, conn.execute(query).fetchone()[0] - before


def test_an_idle_fleet_is_looked_at_once_a_poll_interval(conn: psycopg.Connection) -> None:
    """040: in an idle fleet nobody takes the upkeep's turn, so it stays due, and before 040 every heartbeat
    of every host made the looks, walking every host row (the heartbeat's executor time 1.17, 1.50 and
    2.36 ms at 100, 300 and 1,000 hosts, bench.scale). Now one heartbeat an interval looks."""
    me = register(conn, "me")
    add_hosts(conn, 0, 20)
    assert host_scans(conn, me) == (store.Probe("active", False, False, False), 1)
    peer = fence_of(conn, "peer-007")
    assert host_scans(conn, peer) == (store.Probe("active", False, False, False), 0)  # looked at just now
    # The cost: a host that falls silent is seen by the next look, up to a poll interval later.
    silence(conn, "peer-015", 1000)
    assert host_scans(conn, me)[0].upkeep is False
    look_again(conn)
    assert host_scans(conn, me) == (store.Probe("active", False, False, True), 1)
    # A look that finds upkeep to do is not remembered: every heartbeat says so until the turn is taken.
    assert host_scans(conn, peer) == (store.Probe("active", False, False, True), 1)
    assert store.fleet_upkeep_turn(conn, me, timedelta(seconds=10)) is True
    assert host_scans(conn, peer) == (store.Probe("active", False, False, False), 0)


def test_a_heartbeat_does_not_wait_for_the_upkeep_row(conn: psycopg.Connection, dsn: str) -> None:
    """The row that keeps the look's stamp is also the turn's lease and the explain pass's bookmark: a
    heartbeat that finds it locked looks, and leaves the stamp for the next heartbeat to write."""
    me = register(conn, "me")
    conn.execute("SET lock_timeout = '2s'")  # a heartbeat that waited would fail here, not hang
    with store.connect(dsn) as holder, holder.transaction():
        holder.execute("SELECT 1 FROM unitvisor.fleet_upkeep FOR UPDATE")
        assert host_scans(conn, me) == (store.Probe("active", False, False, False), 1)
        assert host_scans(conn, me)[1] == 1  # nothing stamped: this one looks again
    host_scans(conn, me)
    assert host_scans(conn, me)[1] == 0

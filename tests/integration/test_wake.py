"""Which daemons a new spawn job wakes (sql/010_wake_targets.sql, issue 14): the NOTIFY on
unitvisor_spawn names the hosts that should claim, so that one submit costs a claim on the host that can
take it, not one on every host of the fleet. What the daemon does with the payload is
tests/unit/test_daemon_loop.py's."""

from __future__ import annotations

import contextlib
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from supervisor import store, unitspec
from supervisor.outcomes import Outcome
from tests.integration.conftest import Note, fleet, register, silence, wait_notifies

# Each test runs twice: as the superuser, and with submits made as a unitvisor_submitter login role (the
# trigger reads hosts and attempts, which a submitter may not).
pytestmark = pytest.mark.usefixtures("as_bound_roles")

FMT = unitspec.UNIT_NAME_FORMAT




def spawn_notes(spawn_listener: psycopg.Connection, timeout: float = 2.0) -> list[Note]:
    return wait_notifies(spawn_listener, timeout=timeout, count=100)


def named(spawn_listener: psycopg.Connection) -> frozenset[str] | None:
    """The hosts the one notification sent names (None: every host)."""
    [note] = spawn_notes(spawn_listener)
    assert note.channel == store.SPAWN_CHANNEL
    return store.spawn_hint_targets(note.payload)


def test_a_pinned_submit_wakes_only_its_host(conn: psycopg.Connection, dsn: str,
                                             spawn_listener: psycopg.Connection) -> None:
    with fleet(dsn, conn, 5):
        store.submit_run(conn, argv=["/bin/true"], host_pin="h3")
        assert named(spawn_listener) == {"h3"}


def test_an_unpinned_submit_wakes_two_hosts_with_room(conn: psycopg.Connection, dsn: str,
                                                      spawn_listener: psycopg.Connection) -> None:
    with fleet(dsn, conn, 6, max_runs=4) as fences:
        # h1 is the fullest: three of its four slots taken.
        for _ in range(3):
            store.submit_run(conn, argv=["/bin/true"], host_pin="h1")
        assert len(store.claim(conn, fences[0], 10, FMT)) == 3
        spawn_notes(spawn_listener, timeout=0.5)
        store.submit_run(conn, argv=["/bin/true"])
        targets = named(spawn_listener)
        assert targets is not None and len(targets) == 2 and "h1" not in targets


def test_a_run_the_first_choices_refuse_wakes_a_host_that_accepts_it(conn: psycopg.Connection, dsn: str,
                                                                    spawn_listener: psycopg.Connection) -> None:
    with contextlib.ExitStack() as stack:
        conns = [conn] + [stack.enter_context(store.connect(dsn)) for _ in range(3)]
        # The first two by room and id refuse /opt/tool/*; h4 is the only host that runs it.
        register(conns[0], "h1", max_runs=9, allowed=("/bin/*",))
        register(conns[1], "h2", max_runs=9, allowed=("/bin/*",))
        register(conns[2], "h3", max_runs=2, allowed=("/bin/*",))
        register(conns[3], "h4", max_runs=2, allowed=("/opt/tool/*",))
        store.submit_run(conn, argv=["/opt/tool/x"])
        targets = named(spawn_listener)
        assert targets is not None and "h4" in targets


def test_hosts_that_cannot_claim_are_never_named(conn: psycopg.Connection, dsn: str,
                                                 spawn_listener: psycopg.Connection) -> None:
    with contextlib.ExitStack() as stack:
        conns = [conn] + [stack.enter_context(store.connect(dsn)) for _ in range(4)]
        register(conns[0], "live", max_runs=1)
        register(conns[1], "draining", max_runs=100)
        register(conns[2], "silent", max_runs=100)
        register(conns[3], "cannot", max_runs=100, can_start=False, cannot_start_reason="test")
        register(conns[4], "stopped", max_runs=100)
        conn.execute("UPDATE unitvisor.hosts SET state = 'draining' WHERE id = 'draining'")
        conn.execute("UPDATE unitvisor.hosts SET state = 'stopped' WHERE id = 'stopped'")
        silence(conn, "silent", 120)
        store.submit_run(conn, argv=["/bin/true"])
        assert named(spawn_listener) == {"live"}


def test_a_full_fleet_is_named_nobody_but_a_pin_still_is(conn: psycopg.Connection, dsn: str,
                                                       spawn_listener: psycopg.Connection) -> None:
    with fleet(dsn, conn, 3, max_runs=1) as fences:
        for fence in fences:
            store.submit_run(conn, argv=["/bin/true"], host_pin=fence.host_id)
            assert len(store.claim(conn, fence, 1, FMT)) == 1
        spawn_notes(spawn_listener, timeout=0.5)
        store.submit_run(conn, argv=["/bin/true"])
        # Nobody has a free slot: nobody is told (a daemon claims again when one of its runs ends, and
        # polls); since 048 no notification naming nobody is sent.
        assert spawn_notes(spawn_listener, timeout=0.5) == []
        store.submit_run(conn, argv=["/bin/true"], host_pin="h2")
        assert named(spawn_listener) == {"h2"}


def test_a_submit_that_no_host_accepts_wakes_nobody_but_its_pins(conn: psycopg.Connection, dsn: str,
                                                                spawn_listener: psycopg.Connection) -> None:
    # 038: a rollout whose executable no allowlist names yet. Waking every host for it would cost a claim
    # on each for nothing (with 1,000 hosts, bench.scale saw them starve heartbeats until live hosts were
    # declared dead); each host's heartbeat finds the runs again if an allowlist is widened.
    with fleet(dsn, conn, 4, allowed=("/bin/*",), max_runs=5):
        store.submit_run(conn, argv=["/opt/new/tool"])
        assert spawn_notes(spawn_listener, timeout=0.5) == []
        with conn.transaction():  # a burst that would need every host, of the same kind
            for _ in range(30):
                store.submit_run(conn, argv=["/opt/new/tool"])
        assert spawn_notes(spawn_listener, timeout=0.5) == []
        store.submit_run(conn, argv=["/opt/new/tool"], host_pin="h3")
        assert named(spawn_listener) == {"h3"}  # its host is told, and explains it (a refusal)


def test_a_refused_kind_beside_an_accepted_one_wakes_for_the_accepted(conn: psycopg.Connection, dsn: str,
                                                                     spawn_listener: psycopg.Connection) -> None:
    with fleet(dsn, conn, 4, allowed=("/bin/*",)):
        with conn.transaction():
            store.submit_run(conn, argv=["/opt/new/tool"])
            store.submit_run(conn, argv=["/bin/true"])
        targets = named(spawn_listener)
        assert targets is not None and len(targets) == 2


def test_runs_that_cannot_start_yet_wake_nobody(conn: psycopg.Connection, dsn: str,
                                                spawn_listener: psycopg.Connection) -> None:
    # 038: a claim could not take them now, so no host is woken for them; the heartbeat finds them when
    # they can start (a not_before reached, the run ahead of them on their key ended).
    with fleet(dsn, conn, 4):
        store.submit_run(conn, argv=["/bin/true"], not_before=datetime.now(UTC) + timedelta(hours=1))
        assert spawn_notes(spawn_listener, timeout=0.5) == []
        store.submit_run(conn, argv=["/bin/true"], concurrency_key="k")
        first = named(spawn_listener)  # the key's first run can start: two hosts, as any run
        assert first is not None and len(first) == 2
        with conn.transaction():  # behind it on its key, in one transaction and in many
            for _ in range(30):
                store.submit_run(conn, argv=["/bin/true"], concurrency_key="k")
        store.submit_run(conn, argv=["/bin/true"], concurrency_key="k", host_pin="h4")
        assert spawn_notes(spawn_listener, timeout=0.5) == []
        store.submit_run(conn, argv=["/bin/true"])  # and a run that can start still wakes
        assert named(spawn_listener) == first


def test_a_key_wakes_for_as_many_runs_as_it_has_room_for(conn: psycopg.Connection, dsn: str,
                                                         spawn_listener: psycopg.Connection) -> None:
    with fleet(dsn, conn, 5, max_runs=10) as fences:
        # Its limit, 3, in one transaction of many submits and in one statement: as three keyless runs
        # would (the test below), not as twenty.
        with conn.transaction():
            for _ in range(20):
                store.submit_run(conn, argv=["/bin/true"], concurrency_key="k", concurrency_limit=3)
        assert named(spawn_listener) == {"h1", "h2", "h3"}
        conn.execute("SELECT unitvisor.submit_run(ARRAY['/bin/true'], concurrency_key => 'j', concurrency_limit => 3)"
                     " FROM generate_series(1, 20)")
        assert named(spawn_listener) == {"h1", "h2", "h3"}
        # Room for none: one of k's twenty is live, nineteen queued ahead of a new one.
        assert len(store.claim(conn, fences[0], 10, FMT)) == 2  # one run of a key per claim: k's and j's
        store.submit_run(conn, argv=["/bin/true"], concurrency_key="k", concurrency_limit=3)
        assert spawn_notes(spawn_listener, timeout=0.5) == []


def test_one_transaction_of_many_submits_sends_one_notification_for_all_of_them(
        conn: psycopg.Connection, dsn: str, spawn_listener: psycopg.Connection) -> None:
    with fleet(dsn, conn, 5, max_runs=10):
        with conn.transaction():
            for _ in range(20):
                store.submit_run(conn, argv=["/bin/true"])
            store.submit_run(conn, argv=["/bin/true"], host_pin="h5")
        # Each host's fair share of 20 over 50 slots is 4: five hosts take them within spread_grace.
        assert named(spawn_listener) == {"h1", "h2", "h3", "h4", "h5"}
        with conn.transaction():
            for _ in range(3):
                store.submit_run(conn, argv=["/bin/true"])
        # A share of one run each: three hosts, the first by free slots, then by id.
        assert named(spawn_listener) == {"h1", "h2", "h3"}


def test_a_retry_wakes_hosts_as_a_submit_does(conn: psycopg.Connection, dsn: str,
                                              spawn_listener: psycopg.Connection) -> None:
    """Jobs inserted by a host's transaction (a retry's job, here) are noted the same way."""
    with fleet(dsn, conn, 3) as fences:
        store.submit_run(conn, argv=["/bin/true"], host_pin="h2", max_attempts=2)
        spawn_notes(spawn_listener, timeout=0.5)
        [(_, attempt)] = store.claim(conn, fences[1], 1, FMT)
        store.mark_started(conn, fences[1], attempt, "inv-1")
        store.record_outcome(conn, fences[1], attempt, Outcome("exit-code", "exit:1", "exited 1"), "queued",
                             timedelta(0))
        assert named(spawn_listener) == {"h2"}


def test_the_transaction_notes_keep_environment_names_never_values(conn: psycopg.Connection, dsn: str,
                                                                   spawn_listener: psycopg.Connection) -> None:
    """The notes live in the submitter's session settings until commit (current_setting, pg_settings):
    an environment value may be a secret, and host_refusal needs only the names."""
    with fleet(dsn, conn, 3):
        with conn.transaction():
            store.submit_run(conn, argv=["/bin/true"], environment={"API_TOKEN": "s3cret-value"})
            kinds = conn.execute("SELECT current_setting('unitvisor.spawn_kinds', true)").fetchone()[0]
            assert "API_TOKEN" in kinds and "s3cret-value" not in kinds
        assert named(spawn_listener) is not None

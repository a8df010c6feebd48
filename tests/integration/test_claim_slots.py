"""The fleet's claim slots (sql/migrations/046_claims_take_a_slot.sql, issue 23): at most
`unitvisor.claim_slots` claims walk the queue at once (4 by default), each holding one slot, a
transaction-level advisory lock, until its transaction ends. A claim finds a free slot at once, waits in
a slot's queue when none is free, and walks without one after 10 s (050); a host with no
free run slot takes no claim slot; the slot comes before the fence's lock on the host's row (049). Each
host here claims in a transaction left open, so that the slot its claim took is still held while the
test looks."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest

from supervisor import store, unitspec
from tests.integration.conftest import age_jobs, register

FMT = unitspec.UNIT_NAME_FORMAT
SLOT_KEYS = """SELECT hashtextextended('unitvisor-claim-slot:' || s, 0) FROM generate_series(0, %s - 1) s"""


def held_slots(conn: psycopg.Connection, pid: int, slots: int = 4) -> list[int]:
    """The claim slots (their numbers, 0 to slots - 1) that session `pid` holds."""
    keys = [key for (key,) in conn.execute(SLOT_KEYS, (slots,)).fetchall()]
    held = {key for (key,) in conn.execute(
        "SELECT (classid::bigint << 32) | objid::bigint FROM pg_locks "
        "WHERE locktype = 'advisory' AND objsubid = 1 AND granted AND pid = %s", (pid,)).fetchall()}
    return [n for n, key in enumerate(keys) if key in held]


def claim_in_open_transaction(conn: psycopg.Connection, fence: store.Fence, batch: int = 2) -> int:
    """Runs taken by one claim_jobs, its transaction left open (the caller commits)."""
    conn.execute("BEGIN")
    return len(conn.execute("SELECT * FROM unitvisor.claim_jobs(%s, %s, %s, %s)",
                            (fence.host_id, fence.epoch, batch, FMT)).fetchall())


def hosts(dsn: str, count: int, settings: dict[str, str]) -> list[tuple[psycopg.Connection, store.Fence]]:
    """`count` registered hosts, each on a session of its own with `settings`, and a queue that all of
    them could take from."""
    sessions = []
    for i in range(count):
        conn = store.connect(dsn)
        for name, value in settings.items():
            conn.execute("SELECT set_config(%s, %s, false)", (name, value))
        sessions.append((conn, register(conn, f"h{i}")))
    first = sessions[0][0]
    first.execute("SELECT unitvisor.submit_run(ARRAY['/bin/true']) FROM generate_series(1, 40)")
    age_jobs(first)  # past spread_grace: no fair share holds a claim back
    return sessions


def second_claim_waiting(conn: psycopg.Connection, first: tuple[psycopg.Connection, store.Fence],
                         second: tuple[psycopg.Connection, store.Fence]) -> tuple[threading.Thread, list[int]]:
    """The first host's claim made (its transaction open, its slot held) and the second's claim sent on a
    thread, once it waits for that slot: the thread, and the list it puts the second claim's count in."""
    assert claim_in_open_transaction(*first) == 2
    taken: list[int] = []
    waiter = threading.Thread(target=lambda: taken.append(claim_in_open_transaction(*second)))
    waiter.start()
    deadline = time.monotonic() + 10
    while not conn.execute("SELECT wait_event = 'advisory' FROM pg_stat_activity WHERE pid = %s",
                           (second[0].info.backend_pid,)).fetchone()[0]:
        assert time.monotonic() < deadline, "the second claim never waited for the slot"
        time.sleep(0.02)
    return waiter, taken


def close(sessions: list[tuple[psycopg.Connection, store.Fence]]) -> None:
    for conn, _ in sessions:
        conn.execute("ROLLBACK")
        conn.close()


def test_each_claim_holds_a_slot_of_its_own_until_its_transaction_ends(conn: psycopg.Connection, dsn: str) -> None:
    sessions = hosts(dsn, 4, {})
    try:
        for session, fence in sessions:
            assert claim_in_open_transaction(session, fence) == 2
        held = [held_slots(conn, session.info.backend_pid) for session, _ in sessions]
        # Four claims at once, four slots (the default): each found a free one at once, none two.
        assert sorted(slot for slots in held for slot in slots) == [0, 1, 2, 3], held
        sessions[0][0].execute("COMMIT")
        assert held_slots(conn, sessions[0][0].info.backend_pid) == []
    finally:
        close(sessions)


def test_a_claim_waits_for_a_slot_and_walks_once_one_is_free(conn: psycopg.Connection, dsn: str) -> None:
    first, second = sessions = hosts(dsn, 2, {"unitvisor.claim_slots": "1"})
    try:
        waiter, taken = second_claim_waiting(conn, first, second)
        assert taken == []  # it waits ...
        first[0].execute("COMMIT")
        waiter.join(10)
        assert taken == [2]  # ... and claims once the first claim's transaction ended
        assert held_slots(conn, second[0].info.backend_pid, 1) == [0]
    finally:
        close(sessions)


def test_a_claim_waiting_for_a_slot_leaves_its_hosts_heartbeat_free(conn: psycopg.Connection, dsn: str) -> None:
    # 049: the slot is taken before the fence's share lock on the host's row. Taken after it (046), the
    # waiting claim held the row, and the host's heartbeat (its aside thread, on a session of its own)
    # waited behind its own claim until lock_timeout: 90 failed heartbeats in bench.scale's burst.
    first, second = sessions = hosts(dsn, 2, {"unitvisor.claim_slots": "1"})
    aside = store.connect(dsn)
    try:
        waiter, taken = second_claim_waiting(conn, first, second)
        began = time.monotonic()
        assert store.renew_heartbeat(aside, second[1]) == "active"
        assert time.monotonic() - began < 2  # not behind the claim (lock_timeout is 5 s)
        assert taken == []  # the claim still waits for its slot
        first[0].execute("COMMIT")
        waiter.join(10)
        assert taken == [2]
    finally:
        aside.close()
        close(sessions)


@pytest.mark.parametrize(("settings", "waits"), [
    ({"lock_timeout": "200ms"}, (9.5, 14.0)),
    ({"statement_timeout": "7s"}, (1.5, 4.0)),
    ({"statement_timeout": "4s"}, (0.0, 1.0)),
])
def test_a_claim_waits_10_s_for_a_slot_at_most_then_walks_without_one(
        conn: psycopg.Connection, dsn: str, settings: dict[str, str], waits: tuple[float, float]) -> None:
    # 050: the slot's wait is take_claim_slot's own lock_timeout, 10 s, whatever the session's (200 ms:
    # 046 waited that long, and in a burst most claims gave up at the daemon's 5 s and walked at once),
    # and it ends 5 s before the claim's statement_timeout would (7 s: about 2 s; 4 s: none at all), so
    # that a claim never fails for want of a slot. The session's own lock_timeout is back for the walk.
    first, second = sessions = hosts(dsn, 2, {"unitvisor.claim_slots": "1", **settings})
    try:
        assert claim_in_open_transaction(*first) == 2
        began = time.monotonic()
        assert claim_in_open_transaction(*second) == 2  # not an error: the claim is made
        assert waits[0] <= time.monotonic() - began < waits[1]
        assert held_slots(conn, second[0].info.backend_pid, 1) == []
        assert second[0].execute("SHOW lock_timeout").fetchone()[0] == settings.get("lock_timeout", "5s")
    finally:
        close(sessions)


@pytest.mark.parametrize(("setting", "slots"), [("0", 0), ("-3", 0), ("2", 2), ("lots", 4), ("", 4),
                                                ("99999999999", 4), ("1; DROP TABLE unitvisor.runs", 4)])
def test_the_setting_read(conn: psycopg.Connection, dsn: str, setting: str, slots: int) -> None:
    # Anything but a whole number is the default, so that an operator's typo never stops the fleet's claims;
    # 0 or less: no slot is taken.
    sessions = hosts(dsn, 1, {"unitvisor.claim_slots": setting})
    try:
        session, fence = sessions[0]
        assert claim_in_open_transaction(session, fence) == 2
        held = held_slots(conn, session.info.backend_pid, max(slots, 4))
        assert len(held) == (1 if slots else 0) and all(slot < max(slots, 1) for slot in held), held
    finally:
        close(sessions)


def test_a_full_host_takes_no_slot(conn: psycopg.Connection, dsn: str) -> None:
    sessions = hosts(dsn, 1, {"unitvisor.claim_slots": "1"})
    try:
        session, fence = sessions[0]
        session.execute("UPDATE unitvisor.hosts SET max_runs = 2 WHERE id = %s", (fence.host_id,))
        assert claim_in_open_transaction(session, fence) == 2
        session.execute("COMMIT")
        assert claim_in_open_transaction(session, fence) == 0  # its two run slots are taken
        assert held_slots(conn, session.info.backend_pid, 1) == []
    finally:
        close(sessions)

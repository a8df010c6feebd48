"""Migration 002 (a fleet of hosts on one database) against the real schema: what a host may claim,
backfill and starvation, spread, fencing and takeover, dead hosts, registration, wait reasons,
forgetting hosts, unit owners, the argv[0] constraint and the session limits.

Time is moved with SQL (heartbeat_at, scheduled_at) rather than slept through, but for one second in
one test, where only the clock may change. Tests marked xfail(strict=True) show a product bug that is
not fixed yet: each names the failing case, and fails (XPASS) once the bug is fixed, so that its mark
is removed then.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

from supervisor import globs, store, unitspec
from supervisor.model import Attempt, Run
from supervisor.outcomes import Outcome, retry_delay, run_state_after
from tests.integration.conftest import (
    ALLOW_ALL,
    TABLES,
    age_jobs,
    backend_gone,
    connected,
    declared,
    host_profile,
    register,
    silence,
    silence_said,
)

# Each test runs twice: as the superuser, and with every host call of the store made as a login role
# bound to its host id (tests/integration/conftest.py, as_bound_roles).
pytestmark = pytest.mark.usefixtures("as_bound_roles")

FMT = unitspec.UNIT_NAME_FORMAT
MiB = 1 << 20
WEEK = timedelta(days=7)
SUCCEEDED = Outcome("success", "exit:0", "exited 0")

# submit_run's arguments with their SQL types, all of them (store.submit_run has no retry_on).
ARG_TYPES = {
    "argv": "text[]", "run_user": "text", "memory_max": "bigint", "max_attempts": "integer", "host_pin": "text",
    "priority": "integer", "retry_backoff_sec": "integer", "retry_backoff_max_sec": "integer", "retry_on": "text[]",
    "count_lost": "boolean",  # schema 27
}


def submit(conn: psycopg.Connection, argv0: str = "/bin/true", **values: Any) -> uuid.UUID:
    """unitvisor.submit_run, as a control plane calls it."""
    values = {"argv": [argv0], **values}
    args = sql.SQL(", ").join(
        sql.SQL("{} => %s::{}").format(sql.Identifier(name), sql.SQL(ARG_TYPES[name])) for name in values)
    return conn.execute(sql.SQL("SELECT unitvisor.submit_run({})").format(args), list(values.values())).fetchone()[0]


def claim(conn: psycopg.Connection, fence: store.Fence, batch: int = 100) -> set[uuid.UUID]:
    return {attempt.run_id for _, attempt in store.claim(conn, fence, batch, FMT)}


def claim_jobs(conn: psycopg.Connection, fence: store.Fence, batch: int = 100, **options: str) -> set[uuid.UUID]:
    """unitvisor.claim_jobs directly, with its policy arguments (starve_after, spread_grace)."""
    named = sql.SQL("").join(sql.SQL(", {} => %s::interval").format(sql.Identifier(k)) for k in options)
    query = sql.SQL("SELECT run_id FROM unitvisor.claim_jobs(%s, %s, %s, %s{})").format(named)
    rows = conn.execute(query, [fence.host_id, fence.epoch, batch, FMT, *options.values()]).fetchall()
    return {row[0] for row in rows}


def waits(conn: psycopg.Connection, run_id: uuid.UUID) -> bool:
    """The run is queued, its job available, and no attempt was made."""
    run = store.get_run(conn, run_id)
    jobs = conn.execute("SELECT state FROM unitvisor.spawn_jobs WHERE run_id = %s", (run_id,)).fetchall()
    return run.state == "queued" and jobs == [("available",)] and store.get_attempts(conn, run_id) == []


def host_row(conn: psycopg.Connection, host_id: str) -> dict[str, Any]:
    with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        return cur.execute("SELECT * FROM unitvisor.hosts WHERE id = %s", (host_id,)).fetchone()


def events(conn: psycopg.Connection, run_id: uuid.UUID) -> list[tuple[str, str]]:
    return [(e["state"], e["reason"]) for e in store.get_events(conn, run_id, limit=100)]


def everything(conn: psycopg.Connection) -> dict[str, list[str]]:
    """Every row of every unitvisor table, as text: equal before and after means nothing changed."""
    return {t: [r[0] for r in conn.execute(f"SELECT t::text FROM unitvisor.{t} t ORDER BY t::text")]
            for t in TABLES}


def advisory_locks(conn: psycopg.Connection, pid: int) -> int:
    return conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = %s AND granted",
                        (pid,)).fetchone()[0]


@contextmanager
def connection(dsn: str) -> Iterator[psycopg.Connection]:
    """Another database session (another daemon), with statement_timeout short enough that a test
    which would hang fails instead."""
    with store.connect(dsn) as other:
        other.execute("SET statement_timeout = '10s'")
        yield other


def lost_reason(host: store.DeadHost) -> str:
    return (f"host {host.host_id} was declared dead: silent for {host.silent:.0f} s "
            f"(its host_dead_after is {host.dead_after:g} s)")


def take_over(conn: psycopg.Connection, declarer: store.Fence, dead: list[store.DeadHost]) -> None:
    """What the reconciler does in the declaring transaction, at the store level: each open attempt of a
    host declared dead is settled as `lost` with the declarer's fence, and the run is retried or ended
    by its own policy (outcomes.retry_delay). A run with a cancel request ends cancelled: retry_delay
    returns None for it, and run_state_after('lost') alone would say failed."""
    for host in dead:
        for run, attempt in store.open_attempts(conn, host.host_id):
            delay = retry_delay(run, attempt.attempt, "lost", lambda: 0.0)
            if run.cancel_requested_at is not None:
                next_state = "cancelled"
            else:
                next_state = "queued" if delay is not None else run_state_after("lost")
            assert store.record_outcome(conn, declarer, attempt, Outcome("lost", None, lost_reason(host)),
                                        next_state, delay)


# -- 1. a host claims only what it may run -----------------------------------------------------


def test_a_host_claims_only_the_runs_it_accepts(conn: psycopg.Connection) -> None:
    h1 = register(conn, "h1", allowed=("/usr/bin/*",), run_user="svc", users=("alice",), budget=100 * MiB)
    accepted = {
        submit(conn, "/usr/bin/env"),
        submit(conn, "/usr/bin/env", run_user="alice"),  # in allowed_users
        submit(conn, "/usr/bin/env", run_user="svc"),  # the host's own run_user
        submit(conn, "/usr/bin/env", memory_max=100 * MiB),  # exactly the budget
    }
    refused = {
        submit(conn, "/opt/tool/x"): "executable /opt/tool/x is not allowed",
        submit(conn, "/usr/bin/env", run_user="bob"): "user bob is not allowed",
        submit(conn, "/usr/bin/env", memory_max=100 * MiB + 1): f"memory_max {100 * MiB + 1} bytes is over the "
                                                                "memory budget",
    }
    assert claim(conn, h1) == accepted
    assert all(waits(conn, run_id) for run_id in refused)
    assert claim(conn, h1) == set()
    assert store.probe(conn, h1, WEEK).claimable is False
    # The database says why, per run, with the same function the claim asked.
    for run_id, reason in refused.items():
        assert conn.execute("SELECT unitvisor.host_refusal(h, r) FROM unitvisor.hosts h, unitvisor.runs r "
                            "WHERE h.id = 'h1' AND r.id = %s", (run_id,)).fetchone()[0] == reason

    # Another host that allows them claims them; none was refused or failed on the way.
    h2 = register(conn, "h2", users=("bob",))
    assert claim(conn, h2) == set(refused)
    assert conn.execute("SELECT count(*) FROM unitvisor.attempts WHERE outcome IS NOT NULL").fetchone()[0] == 0


def test_a_host_that_cannot_start_units_claims_nothing(conn: psycopg.Connection) -> None:
    h1 = register(conn, "h1", can_start=False, cannot_start_reason="no systemd")
    run_id = submit(conn)
    assert store.probe(conn, h1, WEEK).claimable is False
    assert claim(conn, h1) == set()
    assert waits(conn, run_id)
    assert claim(conn, register(conn, "h2")) == {run_id}


def test_a_host_with_an_empty_allowlist_claims_nothing(conn: psycopg.Connection) -> None:
    h1 = register(conn, "h1", allowed=())
    run_id = submit(conn)
    assert claim(conn, h1) == set()
    assert waits(conn, run_id)
    assert store.explain_waiting(conn, timedelta(0)) == 1
    assert wait_reason(conn, run_id) == "no live host accepts it: executable /bin/true is not allowed (h1)"


def test_each_run_lands_on_a_host_that_allows_it(conn: psycopg.Connection, dsn: str) -> None:
    with connection(dsn) as other:
        h1 = register(conn, "h1", allowed=("/opt/a/*",))
        h2 = register(other, "h2", allowed=("/opt/b/*", "/opt/both/*"))
        runs = {submit(conn, f"/opt/{'ab'[i % 2]}/tool{i}"): "h1" if i % 2 == 0 else "h2" for i in range(18)}
        runs |= {submit(conn, "/opt/both/x"): "h2", submit(conn, "/opt/both/y"): "h2"}
        # Past spread_grace, so that this is about allowlists only: within it, shares hold back runs
        # that only one host accepts (test_a_run_only_this_host_accepts_is_not_held_back_...).
        age_jobs(conn)
        assert len(claim(conn, h1)) == 9 and len(claim(other, h2)) == 11
        landed = dict(conn.execute("SELECT run_id, host_id FROM unitvisor.attempts").fetchall())
        assert landed == runs
        assert conn.execute("SELECT count(*) FROM unitvisor.runs WHERE state <> 'starting'").fetchone()[0] == 0


# (glob, path, allowed): shell-style, one path component at a time, everything else literal.
GLOBS = [
    ("/usr/bin/*", "/usr/bin/env", True),
    ("/usr/bin/*", "/usr/bin/sub/x", False),  # * stays within one component
    ("/usr/bin/*", "/usr/binx/env", False),
    ("/usr/bin/*", "/usr/bin", False),
    ("/usr/bin/*", "/x/usr/bin/env", False),  # anchored at the start
    ("/opt/run?", "/opt/run1", True),
    ("/opt/run?", "/opt/run", False),  # ? is exactly one character
    ("/opt/run?", "/opt/run12", False),  # anchored at the end
    ("/opt/x?y", "/opt/x/y", False),  # ? is not /
    ("/opt/x?y", "/opt/x.y", True),
    ("/opt/a.b-c+d/tool", "/opt/a.b-c+d/tool", True),
    ("/opt/a.b-c+d/tool", "/opt/aXb-c+d/tool", False),  # the dot is literal
    ("/opt/a.b-c+d/tool", "/opt/a.b-ccd/tool", False),  # the plus is literal
    ("/opt/a.b-c+d/tool", "/opt/a.b-c+d/tools", False),
    ("/opt/$(x)|^{2}\\", "/opt/$(x)|^{2}\\", True),  # regex syntax is literal too
    ("/opt/$(x)|^{2}\\", "/opt/x", False),
    ("/opt/ünï/*", "/opt/ünï/bin", True),
    ("/srv/*-tool", "/srv/my-tool", True),
    ("/srv/*-tool", "/srv/my_tool", False),
]


def test_allowlist_globs_mean_the_same_in_the_database_and_in_python(conn: psycopg.Connection) -> None:
    for index, (glob, path, allowed) in enumerate(GLOBS):
        fence = register(conn, f"g{index}", allowed=(glob,))
        run_id = submit(conn, path, host_pin=f"g{index}")
        assert claim(conn, fence) == ({run_id} if allowed else set()), (glob, path)
        assert globs.matches(path, glob) is allowed, (glob, path)


# -- 2. backfill and the starvation guard ------------------------------------------------------


def test_backfill_claims_a_smaller_run_behind_one_that_does_not_fit(conn: psycopg.Connection) -> None:
    h1 = register(conn, "h1", budget=100 * MiB)
    first = submit(conn, memory_max=80 * MiB, priority=9)
    assert claim(conn, h1, batch=1) == {first}
    too_big_now = submit(conn, memory_max=50 * MiB, priority=5)
    small = submit(conn, memory_max=10 * MiB, priority=1)
    never = submit(conn, memory_max=150 * MiB, priority=7)  # over the budget: never this host's

    assert claim(conn, h1) == {small}  # 80 + 10; the 50M run waits, and does not block the 10M one
    assert claim(conn, h1) == set()
    assert waits(conn, too_big_now) and waits(conn, never)
    [(_, attempt)] = store.open_attempts(conn, "h1", [unitspec.unit_name(first, 1)])
    assert store.record_outcome(conn, h1, attempt, SUCCEEDED, "succeeded")
    assert claim(conn, h1) == {too_big_now}  # 10 + 50
    assert claim(conn, h1) == set()
    assert waits(conn, never)


def test_a_starving_run_reserves_the_host(conn: psycopg.Connection) -> None:
    h1 = register(conn, "h1", budget=100 * MiB)
    first = submit(conn, memory_max=80 * MiB, priority=9)
    assert claim(conn, h1, batch=1) == {first}
    big = submit(conn, memory_max=50 * MiB, priority=5)
    small = submit(conn, memory_max=10 * MiB, priority=1)

    # Due for 10 minutes, longer than starve_after (5 minutes by default): nothing behind it is claimed.
    conn.execute("UPDATE unitvisor.spawn_jobs SET scheduled_at = now() - interval '10 minutes' WHERE run_id = %s",
                 (big,))
    assert claim(conn, h1) == set()
    assert waits(conn, small)
    # With a longer starve_after it is not starving yet, and backfill goes on behind it.
    assert claim_jobs(conn, h1, starve_after="1 hour") == {small}
    other_small = submit(conn, memory_max=10 * MiB, priority=1)
    # And with a shorter one, a run due for two seconds is starving.
    conn.execute("UPDATE unitvisor.spawn_jobs SET scheduled_at = now() - interval '2 seconds' WHERE run_id = %s",
                 (big,))
    assert claim_jobs(conn, h1, starve_after="1 second") == set()
    assert claim_jobs(conn, h1, starve_after="1 minute") == {other_small}

    # Once enough memory is free, the starving run goes first.
    for _, attempt in store.open_attempts(conn, "h1"):
        if attempt.run_id == first:
            store.record_outcome(conn, h1, attempt, SUCCEEDED, "succeeded")
    assert claim(conn, h1) == {big}


# -- 3. spread ---------------------------------------------------------------------------------


def submit_many(conn: psycopg.Connection, count: int) -> set[uuid.UUID]:
    """`count` runs submitted in one transaction: their jobs are due at the very same instant."""
    with conn.transaction():
        return {submit(conn) for _ in range(count)}


def test_each_host_takes_its_fair_share_of_a_burst(conn: psycopg.Connection, dsn: str) -> None:
    with connection(dsn) as c2, connection(dsn) as c3:
        fences = [register(c, f"h{i}", max_runs=100) for i, c in enumerate((conn, c2, c3), 1)]
        ids = submit_many(conn, 60)
        # spread_grace of an hour: the burst stays young (shared out) however slow the machine; with the
        # default second, a loaded CI machine let it age between the first claim and the last.
        taken = [claim_jobs(c, f, batch=32, spread_grace="1 hour") for c, f in zip((conn, c2, c3), fences, strict=True)]
        assert [len(t) for t in taken] == [20, 20, 20]
        assert set().union(*taken) == ids


def test_concurrent_claims_take_fair_shares_and_leave_nothing_behind(conn: psycopg.Connection, dsn: str) -> None:
    """Three daemons woken by the same NOTIFY claim at the same moment. Each must get its share: a
    claim must not lock jobs it does not take (it once locked every row its loop fetched)."""
    conns = [store.connect(dsn) for _ in range(3)]
    try:
        fences = [register(c, f"h{i}", max_runs=100) for i, c in enumerate(conns, 1)]
        ids = submit_many(conn, 60)
        barrier = threading.Barrier(3)
        taken: dict[int, set[uuid.UUID]] = {}
        errors: list[BaseException] = []

        def work(i: int) -> None:
            try:
                barrier.wait(timeout=10)
                # An hour's spread_grace, as in the tests around: on the fresh-clone run's loaded machine
                # more than the default second passed between submit and claim, the jobs were anyone's,
                # and one claim took its whole batch ([8, 20, 32]).
                taken[i] = claim_jobs(conns[i], fences[i], batch=32, spread_grace="1 hour")
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert not errors, errors
        assert sorted(len(t) for t in taken.values()) == [20, 20, 20]
        assert set().union(*taken.values()) == ids
    finally:
        for c in conns:
            c.close()


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0)], ids=["small-first", "large-first"])
def test_shares_are_in_proportion_to_max_runs(conn: psycopg.Connection, dsn: str, order: tuple[int, ...]) -> None:
    with connection(dsn) as c2, connection(dsn) as c3:
        conns = (conn, c2, c3)
        fences = [register(c, f"h{i}", max_runs=m) for i, (c, m) in enumerate(zip(conns, (10, 20, 30),
                                                                                    strict=True), 1)]
        submit_many(conn, 30)
        # An hour's spread_grace, as above: the fresh-clone run's loaded machine let the default second
        # pass between claims, and the first host then took all it had room for ({0: 10, 1: 20, 2: 0}).
        taken = {i: len(claim_jobs(conns[i], fences[i], spread_grace="1 hour")) for i in order}
        assert taken == {0: 5, 1: 10, 2: 15}


def test_jobs_due_for_longer_than_spread_grace_are_anyones(conn: psycopg.Connection, dsn: str) -> None:
    with connection(dsn) as c2, connection(dsn) as c3:
        h1 = register(conn, "h1", max_runs=100)
        register(c2, "h2", max_runs=100)
        register(c3, "h3", max_runs=100)
        submit_many(conn, 30)
        assert len(claim_jobs(conn, h1, spread_grace="1 hour")) == 10  # all young: its share of 30
        assert len(claim_jobs(conn, h1, spread_grace="0 seconds")) == 20  # none young: all it sees
        older = submit_many(conn, 60)
        age_jobs(conn, 2)  # due for 2 s, longer than the default spread_grace of 1 s
        assert claim(conn, h1) == older  # max_runs 100, 30 in flight: all 60 fit


def test_a_single_live_host_gets_everything_it_has_room_for(conn: psycopg.Connection, dsn: str) -> None:
    with connection(dsn) as c2:
        h1 = register(conn, "h1", max_runs=50)
        # Hosts that are not live count for nothing: draining, silent, unable to start, dead, stopped.
        for host in ("draining", "silent", "stopped", "dead"):
            register(c2, host, max_runs=1000)
        register(c2, "cannot", max_runs=1000, can_start=False, cannot_start_reason="test")
        c2.execute("UPDATE unitvisor.hosts SET state = 'draining' WHERE id = 'draining'")
        c2.execute("UPDATE unitvisor.hosts SET state = 'stopped' WHERE id = 'stopped'")
        c2.execute("UPDATE unitvisor.hosts SET state = 'dead' WHERE id = 'dead'")
        silence(conn, "silent", 61)
        submit_many(conn, 60)
        assert len(claim(conn, h1)) == 50
        assert conn.execute("SELECT count(*) FROM unitvisor.spawn_jobs WHERE state = 'available'").fetchone()[0] == 10


@pytest.mark.parametrize("kind", ["allowlist", "pin"])
def test_a_run_only_this_host_accepts_is_not_held_back_for_another_hosts_share(
        conn: psycopg.Connection, dsn: str, kind: str) -> None:
    with connection(dsn) as other:
        h1 = register(conn, "h1", allowed=("/opt/a/*",) if kind == "allowlist" else ALLOW_ALL)
        register(other, "h2", allowed=("/opt/b/*",) if kind == "allowlist" else ALLOW_ALL)
        with conn.transaction():
            ids = {submit(conn, "/opt/a/x", host_pin="h1" if kind == "pin" else None) for _ in range(10)}
        assert claim(conn, h1) == ids


# -- 4. fencing and takeover -------------------------------------------------------------------


def started_run(conn: psycopg.Connection, fence: store.Fence, **values: Any) -> tuple[uuid.UUID, Attempt]:
    run_id = submit(conn, **values)
    [(_, attempt)] = [(r, a) for r, a in store.claim(conn, fence, 1, FMT)]
    assert attempt.run_id == run_id
    store.mark_started(conn, fence, attempt, f"inv-{run_id.hex[:8]}")
    return run_id, attempt


def test_a_host_declared_dead_can_write_nothing(conn: psycopg.Connection, dsn: str) -> None:
    h1 = register(conn, "h1")
    _, running = started_run(conn, h1)
    submit(conn)
    [(_, starting)] = store.claim(conn, h1, 1, FMT)
    waiting = submit(conn)
    with connection(dsn) as other:
        h2 = register(other, "h2")
        silence(conn, "h1", 120)
        connected(conn, "h2")
        with other.transaction():
            [dead] = store.declare_dead_hosts(other, h2, connected_for=3600)
        assert declared([dead], {"h1": 120}) == [("h1", 60.0)]
        row = host_row(conn, "h1")
        assert row["state"] == "dead" and row["epoch"] > h1.epoch
        assert row["dead_at"] is not None
        assert silence_said(row["dead_reason"], 120) == (
            "silent for 120 s (its host_dead_after is 60 s); declared dead by host h2")

        # Before and after its attempts were settled by the declarer: every write of h1 is refused.
        for settled in (False, True):
            if settled:
                with other.transaction():
                    take_over(other, h2, [dead])
            before = everything(conn)
            writes = {
                "claim": lambda: store.claim(conn, h1, 10, FMT),
                "mark_started": lambda: store.mark_started(conn, h1, starting, "inv-late"),
                "record_outcome": lambda: store.record_outcome(conn, h1, running, SUCCEEDED, "succeeded"),
                "retry": lambda: store.record_outcome(conn, h1, running, SUCCEEDED, "queued", timedelta(0)),
                "record_event": lambda: store.record_event(conn, h1, running, "running", "stopping"),
                "probe": lambda: store.probe(conn, h1, WEEK),
                "declare_dead_hosts": lambda: store.declare_dead_hosts(conn, h1, 3600),
            }
            for name, write in writes.items():
                with pytest.raises(store.Fenced, match="h1"):
                    write()
                assert everything(conn) == before, name
            store.mark_host_stopped(conn, h1)  # no error, and nothing changes
            assert everything(conn) == before
        assert waits(conn, waiting)


def test_takeover_settles_each_run_by_its_own_policy(conn: psycopg.Connection, dsn: str) -> None:
    h1 = register(conn, "h1")
    runs = {
        "retry-on-lost": started_run(conn, h1, max_attempts=3, retry_on=["lost"], retry_backoff_sec=60),
        "retry-on-default": started_run(conn, h1, max_attempts=2, retry_backoff_sec=0),
        "at-most-once": started_run(conn, h1, max_attempts=3, retry_on=["exit-code"]),
        "last-attempt": started_run(conn, h1, max_attempts=1, count_lost=True),
        # schema 27: its lost attempt does not use up its one attempt (a backoff of an hour: not due below)
        "lost-not-counted": started_run(conn, h1, max_attempts=1, retry_backoff_sec=3600,
                                        retry_backoff_max_sec=3600),
        "cancel-requested": started_run(conn, h1, max_attempts=3),
    }
    store.cancel_run(conn, runs["cancel-requested"][0])
    submit(conn, host_pin="h1")  # claimed by nobody: h1 has no open attempt for it
    with connection(dsn) as other:
        h2 = register(other, "h2")
        silence(conn, "h1", 90)
        connected(conn, "h2")
        with other.transaction():
            dead = store.declare_dead_hosts(other, h2, connected_for=3600)
            assert [d.host_id for d in dead] == ["h1"]
            take_over(other, h2, dead)

        assert store.open_attempts(conn, "h1") == []
        for label, (run_id, _) in runs.items():
            [row] = store.get_attempts(conn, run_id)
            assert (row.outcome, row.exit_status, row.ended_at is not None) == ("lost", None, True), label
            assert row.reason == lost_reason(dead[0]) and "h1" in row.reason
            assert "silent for 90 s" in silence_said(row.reason, 90)
            last = store.get_events(conn, run_id)[-1]
            assert (last["host_id"], last["attempt"]) == ("h2", 1), label
        state = {label: store.get_run(conn, run_id).state for label, (run_id, _) in runs.items()}
        assert state == {"retry-on-lost": "queued", "retry-on-default": "queued", "at-most-once": "failed",
                         "last-attempt": "failed", "cancel-requested": "cancelled", "lost-not-counted": "queued"}
        finished = {label for label, (run_id, _) in runs.items() if store.get_run(conn, run_id).finished_at}
        assert finished == {"at-most-once", "last-attempt", "cancel-requested"}

        # The retries have new jobs: one due now (backoff 0), one in 30 s (60 s backoff, jitter 0).
        jobs = dict(conn.execute(
            """SELECT run_id, extract(epoch FROM scheduled_at - now())::int FROM unitvisor.spawn_jobs
               WHERE state = 'available' AND run_id = ANY(%s)""",
            ([run_id for run_id, _ in runs.values()],)).fetchall())
        lost, default = runs["retry-on-lost"][0], runs["retry-on-default"][0]
        assert set(jobs) == {lost, default, runs["lost-not-counted"][0]}
        assert jobs[default] <= 0 and 25 <= jobs[lost] <= 30
        # A retry scheduled in the future is not claimable before its time, then it is.
        assert claim(other, h2) == {default}
        assert claim(other, h2) == set()
        conn.execute("UPDATE unitvisor.spawn_jobs SET scheduled_at = now() WHERE run_id = %s", (lost,))
        assert claim(other, h2) == {lost}
        assert [(a.attempt, a.host_id) for a in store.get_attempts(conn, lost)] == [(1, "h1"), (2, "h2")]


def test_a_dead_host_rejoins_with_a_new_epoch_and_its_old_fence_stays_refused(
        conn: psycopg.Connection, dsn: str) -> None:
    old = register(conn, "h1")
    with connection(dsn) as other:
        h2 = register(other, "h2")
        silence(conn, "h1", 120)
        connected(conn, "h2")
        with other.transaction():
            assert [d.host_id for d in store.declare_dead_hosts(other, h2, 3600)] == ["h1"]
    host_epoch_at_death = host_row(conn, "h1")["epoch"]
    # An operator cannot undrain it back to life: only registering does that.
    assert store.set_host_state(conn, "h1", "active") == "dead"
    assert host_row(conn, "h1")["state"] == "dead"
    registration = store.register_host(conn, host_profile("h1"))  # the same instance, after a reboot say
    assert registration.registered and registration.state == "active"
    assert registration.epoch > host_epoch_at_death > old.epoch  # one for the death, one for the rejoin
    assert silence_said(registration.detail, 120) == (
        "rejoined after being declared dead (silent for 120 s (its host_dead_after is 60 s); declared dead by host h2)")
    row = host_row(conn, "h1")
    assert (row["state"], row["dead_at"], row["dead_reason"]) == ("active", None, None)

    new = store.Fence("h1", registration.epoch)
    run_id = submit(conn)
    with pytest.raises(store.Fenced):
        store.claim(conn, old, 10, FMT)
    with pytest.raises(store.Fenced):
        store.probe(conn, old, WEEK)
    assert claim(conn, new) == {run_id}


# -- 5. declare_dead_hosts ---------------------------------------------------------------------


def test_only_hosts_silent_for_longer_than_their_own_dead_after_are_declared(
        conn: psycopg.Connection, dsn: str) -> None:
    declarer = register(conn, "declarer")
    with connection(dsn) as other:
        for host, dead_after in (("quick", 20.0), ("slow", 300.0), ("fresh", 60.0), ("draining", 60.0)):
            register(other, host, dead_after=dead_after)
        silence(conn, "quick", 30)  # past its 20 s
        silence(conn, "slow", 200)  # not past its 300 s
        silence(conn, "draining", 61)
        other.execute("UPDATE unitvisor.hosts SET state = 'draining' WHERE id = 'draining'")
        connected(conn, "declarer", 10_000)
        before = {h: host_row(conn, h)["epoch"] for h in ("slow", "fresh", "declarer")}

        dead = store.declare_dead_hosts(conn, declarer, connected_for=10_000)
        assert declared(dead, {"quick": 30, "draining": 61}) == [("draining", 60.0), ("quick", 20.0)]
        assert {h: host_row(conn, h)["state"] for h in ("quick", "draining", "slow", "fresh", "declarer")} == {
            "quick": "dead", "draining": "dead", "slow": "active", "fresh": "active", "declarer": "active"}
        assert {h: host_row(conn, h)["epoch"] for h in before} == before
        # Once dead, a host is not declared again.
        assert store.declare_dead_hosts(conn, declarer, connected_for=10_000) == []


def test_a_declarer_must_have_been_connected_for_the_silent_hosts_dead_after(
        conn: psycopg.Connection, dsn: str) -> None:
    declarer = register(conn, "declarer")
    with connection(dsn) as other:
        register(other, "x", dead_after=60.0)
        register(other, "y", dead_after=300.0)
        silence(conn, "x", 1000)
        connected(conn, "declarer")
        silence(conn, "y", 1000)
        assert store.declare_dead_hosts(conn, declarer, connected_for=59.9) == []
        assert [d.host_id for d in store.declare_dead_hosts(conn, declarer, connected_for=60.0)] == ["x"]
        assert store.declare_dead_hosts(conn, declarer, connected_for=299) == []
        assert [d.host_id for d in store.declare_dead_hosts(conn, declarer, connected_for=300)] == ["y"]


def test_a_stopped_host_is_declared_dead_only_with_open_attempts(conn: psycopg.Connection, dsn: str) -> None:
    declarer = register(conn, "declarer")
    with connection(dsn) as other:
        idle = register(other, "idle")
        busy = register(other, "busy")
        run_id = submit(conn, host_pin="busy")
        assert claim(other, busy) == {run_id}
        store.mark_host_stopped(other, idle)
        store.mark_host_stopped(other, busy)
        silence(conn, "idle", 1000)
        silence(conn, "busy", 1000)
        connected(conn, "declarer")
        # The probe's upkeep flag agrees: there is a host to declare dead.
        assert store.probe(conn, declarer, WEEK).upkeep is True
        assert [d.host_id for d in store.declare_dead_hosts(conn, declarer, 3600)] == ["busy"]
        assert (host_row(conn, "idle")["state"], host_row(conn, "busy")["state"]) == ("stopped", "dead")
        assert store.probe(conn, declarer, WEEK).upkeep is False


def test_two_declarers_at_once_one_gets_the_hosts_the_other_nothing(conn: psycopg.Connection, dsn: str) -> None:
    with connection(dsn) as c1, connection(dsn) as c2:
        d1 = register(c1, "d1")
        d2 = register(c2, "d2")
        register(conn, "x")
        silence(conn, "x", 1000)
        connected(conn, "d1")
        connected(conn, "d2")
        with c1.transaction():
            assert [d.host_id for d in store.declare_dead_hosts(c1, d1, 3600)] == ["x"]
            with c2.transaction():
                started = time.monotonic()
                assert store.declare_dead_hosts(c2, d2, 3600) == []  # at once: it does not wait
                assert time.monotonic() - started < 2
            raise psycopg.Rollback()  # d1 changes its mind (say, its connection broke)
        # The lock was the transaction's: now d2 gets it, and x.
        with c2.transaction():
            assert [d.host_id for d in store.declare_dead_hosts(c2, d2, 3600)] == ["x"]
        assert host_row(conn, "x")["state"] == "dead" and host_row(conn, "x")["epoch"] > d1.epoch
        assert "declared dead by host d2" in host_row(conn, "x")["dead_reason"]


# -- 6. register_host --------------------------------------------------------------------------


def conflict_free(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k not in ("conflict_at", "conflict_detail")}


def test_a_second_daemon_with_the_same_id_is_refused_while_the_first_holds_it(
        conn: psycopg.Connection, dsn: str) -> None:
    with connection(dsn) as first, connection(dsn) as second:
        assert store.register_host(first, host_profile("h1", instance="A")) == store.Registration(
            True, "active", 1, "registered")
        before = host_row(conn, "h1")
        assert before["conflict_at"] is None
        for instance in ("B", "A"):  # another machine, or a clone of the same one: the session lock decides
            refused = store.register_host(second, host_profile("h1", instance=instance, max_runs=1))
            assert refused == store.Registration(False, None, None, "host id h1 is held by another live daemon "
                                                 "(its database session holds the host lock)")
            after = host_row(conn, "h1")
            assert conflict_free(after) == conflict_free(before)
            assert after["conflict_at"] is not None
            assert re.fullmatch(rf"refused a second daemon: box-h1 \(instance {instance}, backend pid "
                                rf"{second.info.backend_pid}\)", after["conflict_detail"])
        assert advisory_locks(conn, second.info.backend_pid) == 0
        assert advisory_locks(conn, first.info.backend_pid) == 1


def test_registration_after_the_holder_disconnected(conn: psycopg.Connection, dsn: str) -> None:
    first = store.connect(dsn)
    old = register(first, "h1", instance="A")
    pid = first.info.backend_pid
    first.close()
    backend_gone(conn, pid)

    # Another machine while A's heartbeat is fresh: refused (A may be reconnecting), and it lets go of the lock.
    with connection(dsn) as b:
        refused = store.register_host(b, host_profile("h1", instance="B"))
        assert not refused.registered and refused.epoch is None
        assert re.fullmatch(r"host id h1 is held by instance A \(another machine with this id, or this machine before "
                            r"a reboot\), active with 0 attempt\(s\) open, last heard from at [-0-9: ]+ UTC; another "
                            r"instance may take it once it has been silent for its host_dead_after \(60 s\), at "
                            r"[-0-9: ]+ UTC", refused.detail), refused.detail
        assert advisory_locks(conn, b.info.backend_pid) == 0
        assert "instance B" in host_row(conn, "h1")["conflict_detail"]
        assert host_row(conn, "h1")["instance"] == "A"

    # A itself takes it back at once, with the same epoch.
    with connection(dsn) as a:
        assert store.register_host(a, host_profile("h1", instance="A")) == store.Registration(
            True, "active", old.epoch, "registered")
        pid = a.info.backend_pid
    backend_gone(conn, pid)

    # Once A has been silent for longer than its host_dead_after, B takes over with a new epoch.
    conn.execute("UPDATE unitvisor.hosts SET state = 'draining' WHERE id = 'h1'")
    silence(conn, "h1", 61)
    with connection(dsn) as b:
        taken = store.register_host(b, host_profile("h1", instance="B"))
        assert (taken.registered, taken.state, taken.detail) == (True, "draining", "took over the id from instance A")
        assert taken.epoch > old.epoch
        assert host_row(conn, "h1")["instance"] == "B"
        with pytest.raises(store.Fenced):
            store.probe(conn, old, WEEK)


def test_a_daemon_upgraded_from_version_1_registers_at_once(conn: psycopg.Connection) -> None:
    # What version 1's register_host wrote, moments before its daemon stopped for the upgrade.
    conn.execute("INSERT INTO unitvisor.hosts (id, name, max_runs, memory_budget, version, boot_id) "
                 "VALUES ('h1', 'box-h1', 8, NULL, '0.1.0', 'boot-test')")
    assert store.register_host(conn, host_profile("h1")).registered


def test_a_drained_host_stays_drained_across_a_long_reboot(conn: psycopg.Connection, dsn: str) -> None:
    declarer = register(conn, "declarer")
    with connection(dsn) as other:
        h1 = register(other, "h1")
        assert store.set_host_state(conn, "h1", "draining") == "active"
        store.mark_host_stopped(other, h1)
        pid = other.info.backend_pid
    backend_gone(conn, pid)
    silence(conn, "h1", 600)
    connected(conn, "declarer")
    store.declare_dead_hosts(conn, declarer, 3600)
    with connection(dsn) as again:
        assert store.register_host(again, host_profile("h1")).state == "draining"


# -- 7. why a run waits ------------------------------------------------------------------------


def wait_reason(conn: psycopg.Connection, run_id: uuid.UUID) -> str | None:
    return store.get_run(conn, run_id).wait_reason


def waiting_events(conn: psycopg.Connection, run_id: uuid.UUID) -> list[str]:
    return [reason for state, reason in events(conn, run_id) if reason.startswith("waiting: ")]


def test_a_run_no_live_host_accepts_is_explained_once(conn: psycopg.Connection) -> None:
    register(conn, "h1", allowed=("/usr/bin/*",), budget=64 * MiB)
    register(conn, "h2", allowed=("/bin/*",))
    x = submit(conn, "/opt/x")
    bob = submit(conn, "/bin/true", run_user="bob")
    mixed = submit(conn, "/usr/bin/env", memory_max=128 * MiB)
    fine = submit(conn, "/bin/true")

    assert store.explain_waiting(conn, timedelta(hours=1)) == 0  # none has waited that long
    assert store.explain_waiting(conn, timedelta(0)) == 3
    expected = {
        x: "no live host accepts it: executable /opt/x is not allowed (h1, h2)",
        bob: "no live host accepts it: executable /bin/true is not allowed (h1); user bob is not allowed (h2)",
        mixed: (f"no live host accepts it: executable /usr/bin/env is not allowed (h2); memory_max {128 * MiB} "
                "bytes is over the memory budget (h1)"),
        fine: None,
    }
    assert {run_id: wait_reason(conn, run_id) for run_id in expected} == expected
    for _ in range(3):
        assert store.explain_waiting(conn, timedelta(0)) == 0
    for run_id, reason in expected.items():
        assert waiting_events(conn, run_id) == ([f"waiting: {reason}"] if reason else [])

    # A host that accepts x registers: the next pass clears x's reason, without an event. (The other
    # two have a new reason, which names h3 too: one event each.)
    register(conn, "h3", allowed=("/opt/*",))
    assert store.explain_waiting(conn, timedelta(0)) == 2
    assert wait_reason(conn, x) is None
    assert waiting_events(conn, x) == [f"waiting: {expected[x]}"]
    assert wait_reason(conn, bob) == ("no live host accepts it: executable /bin/true is not allowed (h1, h3); "
                                      "user bob is not allowed (h2)")
    # The claim clears it too, before any pass.
    h4 = register(conn, "h4", users=("bob",))
    age_jobs(conn)  # past spread_grace: h4 takes them all, not its share of four hosts
    assert {bob, mixed} <= claim(conn, h4)
    assert wait_reason(conn, bob) is None and wait_reason(conn, mixed) is None
    assert store.get_run(conn, bob).state == "starting"


def test_wait_reasons_of_pinned_runs(conn: psycopg.Connection, dsn: str) -> None:
    declarer = register(conn, "h0")
    with connection(dsn) as other:
        for host in ("dead", "draining", "refuses", "cannot", "silent"):
            register(other, host, allowed=("/usr/bin/*",) if host == "refuses" else ALLOW_ALL,
                     can_start=host != "cannot", cannot_start_reason="no systemd" if host == "cannot" else None)
        store.set_host_state(conn, "draining", "draining")
        silence(conn, "dead", 120)
        connected(conn, "h0")
        assert [d.host_id for d in store.declare_dead_hosts(conn, declarer, 3600)] == ["dead"]
        silence(conn, "silent", 70)  # no longer live, not declared dead yet
        silent_since = conn.execute("SELECT to_char(heartbeat_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS') "
                                    "|| ' UTC' FROM unitvisor.hosts WHERE id = 'silent'").fetchone()[0]
        dead_epoch = host_row(conn, "dead")["epoch"]
        runs = {host: submit(conn, host_pin=host)
                for host in ("ghost", "dead", "draining", "refuses", "cannot", "silent")}
        assert store.explain_waiting(conn, timedelta(0)) == 6
        assert store.explain_waiting(conn, timedelta(0)) == 0
        assert {host: silence_said(wait_reason(conn, run_id), 120) for host, run_id in runs.items()} == {
            "ghost": "pinned to host ghost, which is not known (see unitvisor hosts)",
            "dead": ("pinned to host dead, which is dead (silent for 120 s (its host_dead_after is 60 s); declared "
                     "dead by host h0)"),
            "draining": "pinned to host draining, which is draining",
            "refuses": "pinned to host refuses, which does not accept it: executable /bin/true is not allowed",
            "cannot": "pinned to host cannot, which does not accept it: cannot start units (no systemd)",
            "silent": "pinned to host silent, which has been silent since " + silent_since,
        }
        assert all(len(waiting_events(conn, run_id)) == 1 for run_id in runs.values())

        # The dead host rejoins: its run's reason is cleared by the next pass.
        assert register(other, "dead").epoch > dead_epoch
        assert store.explain_waiting(conn, timedelta(0)) == 0
        assert wait_reason(conn, runs["dead"]) is None


def test_with_no_live_host_at_all(conn: psycopg.Connection) -> None:
    register(conn, "h1")
    store.set_host_state(conn, "h1", "draining")
    run_id = submit(conn)
    assert store.explain_waiting(conn, timedelta(0)) == 1
    assert wait_reason(conn, run_id) == "no live host (every host is dead, stopped, draining or silent)"


def test_a_reason_that_changes_gets_one_event_per_change(conn: psycopg.Connection) -> None:
    register(conn, "h1", allowed=("/usr/bin/*",))
    run_id = submit(conn, "/opt/x", run_user="bob")
    assert store.explain_waiting(conn, timedelta(0)) == 1
    register(conn, "h1", allowed=("/opt/*",))  # now the user is what it refuses
    assert store.explain_waiting(conn, timedelta(0)) == 1
    assert store.explain_waiting(conn, timedelta(0)) == 0
    assert waiting_events(conn, run_id) == ["waiting: no live host accepts it: executable /opt/x is not allowed (h1)",
                                            "waiting: no live host accepts it: user bob is not allowed (h1)"]


def test_concurrent_passes_write_one_event(conn: psycopg.Connection, dsn: str) -> None:
    register(conn, "h1", allowed=())
    run_id = submit(conn)
    result: list[int] = []
    errors: list[BaseException] = []

    def second_pass() -> None:
        try:
            with connection(dsn) as other:
                result.append(store.explain_waiting(other, timedelta(0)))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    with conn.transaction():
        assert store.explain_waiting(conn, timedelta(0)) == 1  # not committed yet: the run row stays locked
        thread = threading.Thread(target=second_pass)
        thread.start()
        with store.connect(dsn) as observer:
            deadline = time.monotonic() + 10
            while not errors and time.monotonic() < deadline and not observer.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE %s",
                    ("%explain_waiting%",)).fetchone()[0]:
                time.sleep(0.01)
    thread.join(timeout=20)
    assert not errors, errors
    assert result == [0]
    assert len(waiting_events(conn, run_id)) == 1


def test_a_run_pinned_to_a_silent_host_gets_one_event_not_one_per_pass(conn: psycopg.Connection) -> None:
    register(conn, "h1")
    run_id = submit(conn, host_pin="h1")
    silence(conn, "h1", 70)
    assert store.explain_waiting(conn, timedelta(0)) == 1
    # A second pass a second later, with nothing changed but the clock. (The one sleep of this file:
    # now() cannot be moved, and moving heartbeat_at instead would change what the host last said.)
    time.sleep(1.05)
    store.explain_waiting(conn, timedelta(0))
    assert len(waiting_events(conn, run_id)) == 1


# -- 8. forget_host ----------------------------------------------------------------------------


def test_forget_host(conn: psycopg.Connection, dsn: str) -> None:
    declarer = register(conn, "h0")
    assert store.forget_host(conn, "nobody") == (None, 0)
    assert store.forget_host(conn, "h0") == ("active", 0)
    with connection(dsn) as other:
        h1 = register(other, "h1")
        run_id = submit(conn, host_pin="h1")
        assert claim(other, h1) == {run_id}
        for state in ("active", "draining"):
            store.set_host_state(conn, "h1", state)
            assert store.forget_host(conn, "h1") == (state, 1)
        silence(conn, "h1", 120)
        connected(conn, "h0")
        with conn.transaction():
            dead = store.declare_dead_hosts(conn, declarer, 3600)
            assert store.forget_host(conn, "h1") == ("dead", 1)  # its attempt is still open
            take_over(conn, declarer, dead)
        assert host_row(conn, "h1") is not None
        assert store.forget_host(conn, "h1") == ("dead", 0)
        assert host_row(conn, "h1") is None
        assert store.forget_host(conn, "h1") == (None, 0)
        # Its history stays; its old fence finds no row.
        assert [a.host_id for a in store.get_attempts(conn, run_id)] == ["h1"]
        with pytest.raises(store.Fenced, match="row is gone"):
            store.claim(other, h1, 10, FMT)
        with pytest.raises(store.Fenced):
            store.probe(other, h1, WEEK)

        stopper = register(other, "stopper")
        store.mark_host_stopped(other, stopper)
        assert store.forget_host(conn, "stopper") == ("stopped", 0)
        assert host_row(conn, "stopper") is None


def test_an_old_fence_stays_refused_after_the_host_was_forgotten(conn: psycopg.Connection, dsn: str) -> None:
    declarer = register(conn, "h0")
    with connection(dsn) as a:
        old = register(a, "h1", instance="A")
        pid = a.info.backend_pid
    backend_gone(conn, pid)
    silence(conn, "h1", 120)
    connected(conn, "h0")
    assert [d.host_id for d in store.declare_dead_hosts(conn, declarer, 3600)] == ["h1"]
    assert store.forget_host(conn, "h1") == ("dead", 0)
    with connection(dsn) as b:
        register(b, "h1", instance="B")  # another machine takes the id
        submit(conn)
        with pytest.raises(store.Fenced):
            store.claim(conn, old, 10, FMT)


# -- 9. unit_owners ----------------------------------------------------------------------------


def test_unit_owners(conn: psycopg.Connection, as_bound_roles: str) -> None:
    h1 = register(conn, "h1")
    h2 = register(conn, "h2")
    a = submit(conn, host_pin="h1")
    b = submit(conn, host_pin="h1")
    c = submit(conn, host_pin="h2")
    age_jobs(conn)  # past spread_grace (see test_a_run_only_this_host_accepts_is_not_held_back...)
    assert claim(conn, h1) == {a, b}
    assert claim(conn, h2) == {c}
    [(_, settled)] = store.open_attempts(conn, "h1", [unitspec.unit_name(b, 1)])
    store.record_outcome(conn, h1, settled, SUCCEEDED, "succeeded")
    names = [unitspec.unit_name(run_id, 1) for run_id in (a, b, c)]
    unknown = unitspec.unit_name(uuid.uuid4(), 1)
    owners = store.unit_owners(conn, [*names, unknown, unitspec.unit_name(a, 2)])
    if as_bound_roles == "bound roles":
        # Asked as a host that may not see runs pinned to h1 and h2 (sql/014_host_reads.sql): each unit
        # is still held (open elsewhere, or ended), without whose it is or how it ended.
        assert owners == {names[0]: store.UnitOwner(None, None), names[1]: store.UnitOwner(None, "ended"),
                          names[2]: store.UnitOwner(None, None)}
    else:
        assert owners == {
            names[0]: store.UnitOwner("h1", None),
            names[1]: store.UnitOwner("h1", "success"),
            names[2]: store.UnitOwner("h2", None),
        }
    assert store.unit_owners(conn, []) == {}


# -- 10. argv[0] must be normalised -------------------------------------------------------------


@pytest.mark.parametrize("path", ["/usr/bin/../x", "//x", "/x/./y", "/x/", "/x//y", "/./x", "/x/.", "/x/..",
                                  "/..", "/.", "/x/./"])
def test_a_path_that_is_not_normalised_is_refused_at_submit(conn: psycopg.Connection, path: str) -> None:
    with pytest.raises(psycopg.errors.CheckViolation) as info:
        submit(conn, path)
    assert info.value.diag.constraint_name == "runs_argv0_normalised"
    with pytest.raises(store.DatabaseError, match="runs_argv0_normalised"):
        store.submit_run(conn, argv=[path])
    assert conn.execute("SELECT count(*) FROM unitvisor.runs").fetchone()[0] == 0
    # The daemon's own check agrees: it would refuse it too.
    with pytest.raises(unitspec.Refused, match="normalised"):
        unitspec._check_executable([path], ALLOW_ALL)


@pytest.mark.parametrize("path", ["/x/...", "/x/.y", "/x/y.", "/x/..y", "/x-y/z.", "/a/b/c"])
def test_a_normalised_path_is_accepted(conn: psycopg.Connection, path: str) -> None:
    assert store.get_run(conn, submit(conn, path)).argv == [path]
    unitspec._check_executable([path], ("/*", "/*/*", "/*/*/*"))


def test_a_run_from_before_002_with_a_path_not_normalised_breaks_nothing(empty_dsn: str, tmp_path) -> None:
    (tmp_path / "001_schema.sql").write_text((store.MIGRATIONS_DIR / "001_schema.sql").read_text())
    with store.connect(empty_dsn) as conn:
        assert store.migrate(conn, tmp_path) == ["001_schema"]
        legacy = [submit(conn, "//x"), submit(conn, "/usr/bin/../x")]  # both accepted by version 1
        assert store.migrate(conn)[0] == "002_fleet"
        fine = submit(conn, "/a/b/c/d")
        register(conn, "h0", allowed=("/bin/*",))
        assert store.explain_waiting(conn, timedelta(0)) == 3  # no host accepts any of them
        assert store.cancel_run(conn, legacy[0]) == store.Transition("cancelled", True)
        h1 = register(conn, "h1", allowed=("/*/*/*/*",))  # accepts /usr/bin/../x as well as /a/b/c/d
        assert fine in claim(conn, h1)


# -- 11. session limits ------------------------------------------------------------------------


def test_connect_sets_the_session_limits(conn: psycopg.Connection) -> None:
    shown = {name: conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()[0]
             for name in store.SESSION_SETTINGS}
    assert shown == {"lock_timeout": "5s", "statement_timeout": "15s", "idle_in_transaction_session_timeout": "30s",
                     "jit": "off"}
    store.set_idle_session_timeout(conn, 1.5)
    assert conn.execute("SHOW idle_session_timeout").fetchone()[0] == "1500ms"


def test_a_row_lock_held_elsewhere_fails_within_lock_timeout(conn: psycopg.Connection, dsn: str) -> None:
    run_id = submit(conn)
    with psycopg.connect(dsn, autocommit=True) as holder:  # not ours: no limits of its own
        with holder.transaction():
            holder.execute("SELECT 1 FROM unitvisor.runs WHERE id = %s FOR UPDATE", (run_id,))
            started = time.monotonic()
            with pytest.raises(psycopg.errors.LockNotAvailable):
                store.cancel_run(conn, run_id)
            elapsed = time.monotonic() - started
    assert 4.5 <= elapsed < 10
    assert store.get_run(conn, run_id).state == "queued"
    assert store.cancel_run(conn, run_id) == store.Transition("cancelled", True)  # and the session goes on


# -- stale jobs --------------------------------------------------------------------------------


def test_the_probe_and_the_claim_agree_on_a_stale_job_pinned_elsewhere(conn: psycopg.Connection) -> None:
    h1 = register(conn, "h1")
    run_id = submit(conn, host_pin="gone")
    conn.execute("UPDATE unitvisor.runs SET state = 'cancelled', finished_at = now() WHERE id = %s", (run_id,))
    assert claim(conn, h1) == set()
    # The claim found nothing to claim or discard, so the probe must not send it claiming again.
    assert store.probe(conn, h1, WEEK).claimable is False


def test_a_stale_job_of_a_cancelled_run_is_discarded_not_claimed(conn: psycopg.Connection) -> None:
    h1 = register(conn, "h1", allowed=("/usr/bin/*",))  # it would refuse the run itself: it still cleans up
    run_id = submit(conn)
    conn.execute("UPDATE unitvisor.runs SET state = 'cancelled', finished_at = now() WHERE id = %s", (run_id,))
    assert store.probe(conn, h1, WEEK).claimable is True
    assert claim(conn, h1) == set()
    assert conn.execute("SELECT state, claimed_by, error FROM unitvisor.spawn_jobs WHERE run_id = %s",
                        (run_id,)).fetchall() == [("discarded", "h1", "run is already cancelled")]
    assert store.probe(conn, h1, WEEK).claimable is False
    assert store.get_attempts(conn, run_id) == []


def test_a_cancel_racing_a_retry_leaves_no_job_behind(conn: psycopg.Connection, dsn: str) -> None:
    h1 = register(conn, "h1")
    run_id, attempt = started_run(conn, h1, max_attempts=3)
    result: list[store.Transition] = []
    errors: list[BaseException] = []

    def cancel() -> None:
        try:
            with connection(dsn) as other:
                result.append(store.cancel_run(other, run_id))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    with conn.transaction():
        store.record_outcome(conn, h1, attempt, Outcome("exit-code", "exit:1", "exited 1"), "queued",
                             timedelta(minutes=1))
        thread = threading.Thread(target=cancel)
        thread.start()
        with store.connect(dsn) as observer:
            deadline = time.monotonic() + 10
            while not errors and time.monotonic() < deadline and not observer.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE %s",
                    ("%unitvisor.cancel_run(%",)).fetchone()[0]:  # the cancel waits for the run's row
                time.sleep(0.01)
    thread.join(timeout=20)
    assert not errors, errors
    assert result == [store.Transition("cancelled", True)]
    assert store.get_run(conn, run_id).state == "cancelled"
    assert conn.execute("SELECT count(*) FROM unitvisor.spawn_jobs WHERE run_id = %s AND state = 'available'",
                        (run_id,)).fetchone()[0] == 0
    assert store.resume_run(conn, run_id) == store.Transition("queued", True)


def test_record_outcome_of_an_unknown_attempt_changes_nothing(conn: psycopg.Connection) -> None:
    h1 = register(conn, "h1")
    ghost = Attempt(run_id=uuid.uuid4(), attempt=1, host_id="h1", unit_name=unitspec.unit_name(uuid.uuid4(), 1))
    before = everything(conn)
    assert store.record_outcome(conn, h1, ghost, SUCCEEDED, "succeeded") is False
    store.mark_started(conn, h1, ghost, "inv")
    assert everything(conn) == before


def test_a_run_read_by_the_claim_is_as_the_database_holds_it(conn: psycopg.Connection) -> None:
    h1 = register(conn, "h1")
    run_id = submit(conn, "/usr/bin/env", memory_max=8 * MiB, priority=3, max_attempts=2, retry_on=["lost"])
    conn.execute("INSERT INTO unitvisor.run_waits (run_id, reason) VALUES (%s, 'stale')", (run_id,))
    [(run, attempt)] = store.claim(conn, h1, 10, FMT)
    assert isinstance(run, Run)
    assert (run.state, run.wait_reason, run.argv, run.memory_max, run.retry_on) == (
        "starting", None, ["/usr/bin/env"], 8 * MiB, ["lost"])
    assert store.get_run(conn, run_id).wait_reason is None
    assert attempt.unit_name == unitspec.unit_name(run_id, 1)

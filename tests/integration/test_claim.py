"""store.claim: order, batch, capacity, memory budget, scheduling, host pins, stale jobs, concurrency, retries."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta

import psycopg
import pytest

from supervisor import store, unitspec
from supervisor.model import Attempt, Run
from supervisor.outcomes import Outcome
from tests.integration.conftest import age_jobs, fence_of, register

# Each test runs twice: as the superuser, and with every host call of the store made as a login role
# bound to its host id (tests/integration/conftest.py, as_bound_roles).
pytestmark = pytest.mark.usefixtures("as_bound_roles")

MiB = 1 << 20
FAILED = Outcome("exit-code", "exit:1", "exited with status 1")
SUCCEEDED = Outcome("success", "exit:0", "exited 0")


def submit(conn: psycopg.Connection, **values: object) -> uuid.UUID:
    values.setdefault("argv", ["/bin/true"])
    return store.submit_run(conn, **values)


def claim(conn: psycopg.Connection, host: str = "h1", batch: int = 100, max_runs: int = 1000,
          budget: int | None = None) -> list[tuple[Run, Attempt]]:
    """Claim as `host`, registered (again: same instance, same epoch) with this max_runs and budget
    first: capacity and budget come from the host's row."""
    return store.claim(conn, register(conn, host, max_runs=max_runs, budget=budget), batch,
                       unitspec.UNIT_NAME_FORMAT)


def settle(conn: psycopg.Connection, attempt: Attempt, outcome: Outcome, next_state: str,
           retry_delay: timedelta | None = None) -> bool:
    """record_outcome as the attempt's own host."""
    return store.record_outcome(conn, fence_of(conn, attempt.host_id), attempt, outcome, next_state, retry_delay)


def claimed_ids(pairs: list[tuple[Run, Attempt]]) -> set[uuid.UUID]:
    return {attempt.run_id for _, attempt in pairs}


def schedule(conn: psycopg.Connection, run_id: uuid.UUID, offset: str) -> None:
    conn.execute("UPDATE unitvisor.spawn_jobs SET scheduled_at = now() + %s::interval "
                 "WHERE run_id = %s AND state = 'available'", (offset, run_id))


def job_states(conn: psycopg.Connection, run_id: uuid.UUID) -> list[tuple]:
    return conn.execute("SELECT state, claimed_by, error FROM unitvisor.spawn_jobs WHERE run_id = %s ORDER BY id",
                        (run_id,)).fetchall()


def attempt_count(conn: psycopg.Connection) -> int:
    return conn.execute("SELECT count(*) FROM unitvisor.attempts").fetchone()[0]


def test_claim_creates_the_attempt_moves_the_run_and_claims_the_job(conn: psycopg.Connection) -> None:
    run_id = submit(conn, memory_max=64 * MiB)
    [(run, attempt)] = claim(conn, host="host-a")

    assert run.id == run_id and run.state == "starting" and run.memory_max == 64 * MiB
    assert attempt.run_id == run_id
    assert attempt.attempt == 1
    assert attempt.host_id == "host-a"
    assert attempt.unit_name == unitspec.unit_name(run_id, 1) == f"unitvisor-run-{run_id}-1.service"
    assert unitspec.parse_unit_name(attempt.unit_name) == (run_id, 1)
    assert attempt.claimed_at is not None
    assert (attempt.started_at, attempt.ended_at, attempt.outcome, attempt.exit_status) == (None, None, None, None)

    # What the database holds agrees with what claim returned.
    assert store.get_attempts(conn, run_id) == [attempt]
    assert store.get_run(conn, run_id).state == "starting"
    events = store.get_events(conn, run_id)
    assert [(e["state"], e["attempt"], e["host_id"]) for e in events] == [
        ("queued", None, None), ("starting", 1, "host-a")]
    assert "host-a" in events[-1]["reason"]
    job = conn.execute("SELECT state, claimed_by, claimed_at IS NOT NULL, error FROM unitvisor.spawn_jobs "
                       "WHERE run_id = %s", (run_id,)).fetchall()
    assert job == [("claimed", "host-a", True, None)]

    # Nothing is left to claim, by this host or any other.
    assert claim(conn, host="host-a") == []
    assert claim(conn, host="host-b") == []


def test_claim_order_is_priority_then_scheduled_at_then_id(conn: psycopg.Connection) -> None:
    a = submit(conn, priority=0)
    b = submit(conn, priority=5)
    c = submit(conn, priority=5)
    d = submit(conn, priority=0)
    e = submit(conn, priority=0)
    f = submit(conn, priority=-1)
    schedule(conn, a, "-30 minutes")
    schedule(conn, b, "-40 minutes")
    schedule(conn, c, "-50 minutes")  # same priority as b, scheduled earlier: first
    # d and e are scheduled at the very same instant: the job id decides, d (submitted first) wins.
    conn.execute("UPDATE unitvisor.spawn_jobs SET scheduled_at = now() - interval '55 minutes' "
                 "WHERE run_id = ANY(%s)", ([d, e],))
    schedule(conn, f, "-59 minutes")  # the earliest, but the lowest priority: last

    order = []
    while pairs := claim(conn, batch=1):
        assert len(pairs) == 1
        order.append(pairs[0][1].run_id)
    assert order == [c, b, d, e, a, f]


def test_claim_takes_the_first_jobs_of_the_order_in_one_batch(conn: psycopg.Connection) -> None:
    low = [submit(conn, priority=1) for _ in range(3)]
    high = [submit(conn, priority=9) for _ in range(2)]
    assert claimed_ids(claim(conn, batch=2)) == set(high)
    assert claimed_ids(claim(conn, batch=2)) == set(low[:2])


def test_claim_respects_the_batch_size(conn: psycopg.Connection) -> None:
    ids = [submit(conn) for _ in range(5)]
    first = claim(conn, batch=2)
    assert len(first) == 2
    assert conn.execute("SELECT count(*) FROM unitvisor.spawn_jobs WHERE state = 'available'").fetchone()[0] == 3
    second = claim(conn, batch=2)
    third = claim(conn, batch=2)
    assert (len(second), len(third)) == (2, 1)
    assert claimed_ids(first) | claimed_ids(second) | claimed_ids(third) == set(ids)
    assert claim(conn, batch=0) == []


def test_claim_respects_max_runs_minus_this_hosts_open_attempts(conn: psycopg.Connection) -> None:
    ids = [submit(conn) for _ in range(8)]
    h1_first = claim(conn, host="h1", batch=2, max_runs=3)
    assert len(h1_first) == 2
    h1_second = claim(conn, host="h1", batch=10, max_runs=3)
    assert len(h1_second) == 1  # 3 - 2 open attempts
    assert claim(conn, host="h1", batch=10, max_runs=3) == []
    # A max_runs below what is already running (a lowered setting) claims nothing, and is no error.
    assert claim(conn, host="h1", batch=10, max_runs=1) == []

    # Another host's open attempts do not count against h1, nor h1's against it.
    assert len(claim(conn, host="h2", batch=10, max_runs=3)) == 3

    # An attempt with an outcome is no longer open: h1 gets one slot back.
    _, attempt = h1_first[0]
    assert settle(conn, attempt, SUCCEEDED, "succeeded")
    h1_third = claim(conn, host="h1", batch=10, max_runs=3)
    assert len(h1_third) == 1
    assert claim(conn, host="h1", batch=10, max_runs=3) == []
    left = conn.execute("SELECT count(*) FROM unitvisor.spawn_jobs WHERE state = 'available'").fetchone()[0]
    assert left == len(ids) - 7


def test_claim_respects_the_memory_budget(conn: psycopg.Connection) -> None:
    budget = 350 * MiB
    r100 = submit(conn, memory_max=100 * MiB, priority=3)
    r200 = submit(conn, memory_max=200 * MiB, priority=2)
    r300 = submit(conn, memory_max=300 * MiB, priority=1)

    first = claim(conn, batch=10, budget=budget)
    assert claimed_ids(first) == {r100, r200}  # 300M; with r300 it would be 600M
    assert job_states(conn, r300) == [("available", None, None)]
    assert store.get_run(conn, r300).state == "queued"

    # 300M are in use: another 300M does not fit.
    assert claim(conn, batch=10, budget=budget) == []
    # Another host's usage is its own: it has the whole budget.
    # (r300 stays for h1 below, so try with a job of its own that is pinned to h2.)
    r_h2 = submit(conn, memory_max=300 * MiB, host_pin="h2", priority=10)
    assert claimed_ids(claim(conn, host="h2", batch=10, budget=budget)) == {r_h2}

    attempts = {a.run_id: a for _, a in first}
    assert settle(conn, attempts[r200], SUCCEEDED, "succeeded")
    assert claim(conn, batch=10, budget=budget) == []  # 100M + 300M > 350M
    assert settle(conn, attempts[r100], SUCCEEDED, "succeeded")
    assert claimed_ids(claim(conn, batch=10, budget=budget)) == {r300}  # 0 + 300M fits


def test_a_run_exactly_filling_the_budget_is_claimed(conn: psycopg.Connection) -> None:
    a = submit(conn, memory_max=100 * MiB, priority=2)
    b = submit(conn, memory_max=156 * MiB, priority=1)
    c = submit(conn, memory_max=1 * MiB, priority=0)
    assert claimed_ids(claim(conn, batch=10, budget=256 * MiB)) == {a, b}
    assert job_states(conn, c) == [("available", None, None)]


def test_without_a_budget_memory_is_not_limited(conn: psycopg.Connection) -> None:
    ids = {submit(conn, memory_max=1 << 40) for _ in range(3)}
    assert claimed_ids(claim(conn, batch=10, budget=None)) == ids


def test_a_job_scheduled_in_the_future_is_not_claimed(conn: psycopg.Connection) -> None:
    later = submit(conn, priority=100)
    now = submit(conn)
    schedule(conn, later, "1 hour")
    assert claimed_ids(claim(conn, batch=10)) == {now}
    assert claim(conn, batch=10) == []
    assert job_states(conn, later) == [("available", None, None)]
    assert store.get_run(conn, later).state == "queued"

    schedule(conn, later, "-1 second")
    assert claimed_ids(claim(conn, batch=10)) == {later}


def test_host_pins(conn: psycopg.Connection) -> None:
    elsewhere = submit(conn, host_pin="other-host", priority=10)
    here = submit(conn, host_pin="this-host")
    anywhere = submit(conn)
    assert claimed_ids(claim(conn, host="this-host", batch=10)) == {here, anywhere}
    assert job_states(conn, elsewhere) == [("available", None, None)]
    assert claim(conn, host="this-host", batch=10) == []
    assert claim(conn, host="third-host", batch=10) == []
    [(run, attempt)] = claim(conn, host="other-host", batch=10)
    assert (run.id, attempt.host_id) == (elsewhere, "other-host")


@pytest.mark.parametrize("terminal", ["succeeded", "failed", "cancelled"])
def test_a_job_whose_run_is_already_finished_is_discarded(conn: psycopg.Connection, terminal: str) -> None:
    stale = submit(conn, priority=5)
    conn.execute("UPDATE unitvisor.runs SET state = %s, finished_at = now() WHERE id = %s", (terminal, stale))
    fresh = submit(conn)

    assert claimed_ids(claim(conn, host="h1", batch=10)) == {fresh}
    assert job_states(conn, stale) == [("discarded", "h1", f"run is already {terminal}")]
    assert store.get_attempts(conn, stale) == []
    assert store.get_run(conn, stale).state == terminal
    assert [e["state"] for e in store.get_events(conn, stale)] == ["queued"]


def test_a_second_job_for_a_starting_run_is_discarded(conn: psycopg.Connection) -> None:
    run_id = submit(conn)
    [(_, first)] = claim(conn, host="h1")
    # A duplicate job (a control plane's bug, or a race) for the run that is already starting.
    conn.execute("INSERT INTO unitvisor.spawn_jobs (run_id) VALUES (%s)", (run_id,))
    assert claim(conn, host="h2") == []
    assert job_states(conn, run_id) == [("claimed", "h1", None), ("discarded", "h2", "run is already starting")]
    assert store.get_attempts(conn, run_id) == [first]
    assert store.get_run(conn, run_id).state == "starting"

    # The same for a running run.
    store.mark_started(conn, fence_of(conn, "h1"), first, "inv")
    conn.execute("INSERT INTO unitvisor.spawn_jobs (run_id) VALUES (%s)", (run_id,))
    assert claim(conn, host="h2") == []
    assert job_states(conn, run_id)[-1] == ("discarded", "h2", "run is already running")
    assert len(store.get_attempts(conn, run_id)) == 1


def test_a_claim_skips_jobs_locked_by_another_claim(conn: psycopg.Connection, dsn: str) -> None:
    ids = {submit(conn) for _ in range(6)}
    age_jobs(conn)  # older than spread_grace: this is about locks, not about each host's share
    with store.connect(dsn) as other:
        other.execute("SET statement_timeout = '10s'")
        register(conn, "h1")
        register(other, "h2")  # one connection per host id, as daemons do
        with conn.transaction():
            mine = claim(conn, host="h1", batch=2)  # still uncommitted: its two jobs stay locked
            assert len(mine) == 2
            theirs = claim(other, host="h2", batch=100)  # must not wait for h1, nor take its jobs
            assert len(theirs) == 4
        assert claimed_ids(mine) | claimed_ids(theirs) == ids
        assert not claimed_ids(mine) & claimed_ids(theirs)
    assert attempt_count(conn) == 6


def _while_h1_holds(conn: psycopg.Connection, dsn: str, held: int, more: int, batch: int) -> tuple[int, int]:
    """h1 claims `held` jobs and keeps them locked (uncommitted) while h2 claims with `batch`, of `held +
    more` queued in that order: how many h2 got, and how many h1 holds."""
    for _ in range(held + more):
        submit(conn)
    age_jobs(conn)  # older than spread_grace: this is about locks, not about each host's share
    with store.connect(dsn) as other:
        other.execute("SET statement_timeout = '10s'")
        register(conn, "h1")
        register(other, "h2")
        with conn.transaction():
            mine = claim(conn, host="h1", batch=held)
            theirs = claim(other, host="h2", batch=batch)
            other.commit()
    return len(theirs), len(mine)


def test_jobs_another_claim_holds_are_not_counted_as_looked_at(conn: psycopg.Connection, dsn: str) -> None:
    """039: before it, the 10 jobs h1 holds counted against h2's 4 x batch (8) jobs looked at, and h2's
    claim came back empty with 5 jobs free behind them: in a burst, most claims of a loaded fleet."""
    assert _while_h1_holds(conn, dsn, held=10, more=5, batch=2) == (2, 10)


def test_a_claim_passes_over_at_most_32_batches_of_jobs_others_hold(conn: psycopg.Connection, dsn: str) -> None:
    """The bound on the walk (039): past 32 x batch jobs that other claims hold, the claim stops, empty
    here though 5 jobs are free behind the 70 held; the next claim, or another host's, takes them."""
    assert _while_h1_holds(conn, dsn, held=70, more=5, batch=2) == (0, 70)
    # h1's claim committed: its jobs are no longer walked. (As h1, on its own connection: h2's session, which
    # holds h2's registration lock, may not be gone from the server yet.)
    assert len(claim(conn, host="h1", batch=2)) == 2


def test_concurrent_claims_never_claim_a_job_twice(conn: psycopg.Connection, dsn: str) -> None:
    total = 200
    ids = {submit(conn) for _ in range(total)}
    age_jobs(conn)  # older than spread_grace: this is about locks, not about each host's share
    barrier = threading.Barrier(2)
    results: dict[str, list[uuid.UUID]] = {"h1": [], "h2": []}
    errors: list[BaseException] = []

    def worker(host: str) -> None:
        try:
            with store.connect(dsn) as c:
                c.execute("SET statement_timeout = '30s'")
                barrier.wait(timeout=10)
                while True:
                    # Each claim in a transaction of its own that stays open a moment after the claim,
                    # so that the other thread claims while these jobs are locked.
                    with c.transaction():
                        pairs = claim(c, host=host, batch=7, max_runs=10_000)
                        time.sleep(0.005)
                    if not pairs:
                        # Empty: either all is claimed, or every remaining job was locked by the other.
                        if c.execute("SELECT count(*) FROM unitvisor.spawn_jobs "
                                     "WHERE state = 'available'").fetchone()[0] == 0:
                            return
                        continue
                    results[host].extend(a.run_id for _, a in pairs)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(host,)) for host in results]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors

    h1, h2 = results["h1"], results["h2"]
    assert len(h1) == len(set(h1)) and len(h2) == len(set(h2))
    assert not set(h1) & set(h2)
    assert set(h1) | set(h2) == ids
    assert h1 and h2, "both claimers should have claimed something"
    rows = conn.execute("SELECT run_id, count(*), max(attempt) FROM unitvisor.attempts GROUP BY run_id").fetchall()
    assert len(rows) == total and all(n == 1 and top == 1 for _, n, top in rows)
    by_host = dict(conn.execute("SELECT claimed_by, count(*) FROM unitvisor.spawn_jobs GROUP BY claimed_by"))
    assert by_host == {"h1": len(h1), "h2": len(h2)}
    starting = conn.execute("SELECT count(*) FROM unitvisor.runs WHERE state = 'starting'").fetchone()[0]
    assert starting == total


def test_a_retry_claims_attempt_two(conn: psycopg.Connection) -> None:
    run_id = submit(conn, max_attempts=3, priority=4)
    [(_, first)] = claim(conn, host="h1")
    store.mark_started(conn, fence_of(conn, "h1"), first, "inv-1")
    assert settle(conn, first, FAILED, "queued", retry_delay=timedelta(0))
    assert store.get_run(conn, run_id).state == "queued"

    [(run, second)] = claim(conn, host="h2")
    assert run.state == "starting"
    assert second.attempt == 2
    assert second.host_id == "h2"
    assert second.unit_name == unitspec.unit_name(run_id, 2)
    assert second.unit_name.endswith(f"{run_id}-2.service")
    assert [a.attempt for a in store.get_attempts(conn, run_id)] == [1, 2]
    jobs = conn.execute("SELECT state, claimed_by, priority FROM unitvisor.spawn_jobs WHERE run_id = %s ORDER BY id",
                        (run_id,)).fetchall()
    assert jobs == [("claimed", "h1", 4), ("claimed", "h2", 4)]

    # And a third time, after the second one fails too.
    assert settle(conn, second, FAILED, "queued", retry_delay=timedelta(0))
    [(_, third)] = claim(conn, host="h1")
    assert (third.attempt, third.unit_name) == (3, unitspec.unit_name(run_id, 3))


def test_a_run_submitted_while_the_claim_waits_comes_with_its_row(conn: psycopg.Connection, dsn: str) -> None:
    """The claim statement's snapshot is taken before claim_jobs picks its jobs (each statement inside it
    sees later commits): a run committed in between is claimed, and must come back with its row, not a
    run of NULLs (bench.scale's 1,000 hosts hit it: "no unit name for run None attempt 1")."""
    fence = register(conn, "h1")
    done: dict[str, object] = {}
    with store.connect(dsn) as blocker, store.connect(dsn) as submitter:
        blocker.execute("BEGIN")
        # check_fence's FOR SHARE on the host's row waits behind this, after the statement's snapshot.
        blocker.execute("SELECT 1 FROM unitvisor.hosts WHERE id = 'h1' FOR UPDATE")
        claimer = threading.Thread(target=lambda: done.setdefault(
            "pairs", store.claim(conn, fence, 10, unitspec.UNIT_NAME_FORMAT)))
        claimer.start()
        deadline = time.monotonic() + 30
        while not blocker.execute("SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = %s "
                                  "AND wait_event_type = 'Lock')", (conn.info.backend_pid,)).fetchone()[0]:
            assert time.monotonic() < deadline, "the claim never waited for the host's row"
            time.sleep(0.05)
        run_id = submit(submitter)  # committed after the claim's snapshot, before its jobs are picked
        age_jobs(submitter)  # older than spread_grace: this is about snapshots, not about a host's share
        blocker.rollback()  # within the claim's 5 s lock_timeout
        claimer.join(30)
    [(run, attempt)] = done["pairs"]
    assert attempt.run_id == run_id
    assert run.id == run_id and run.argv == ["/bin/true"] and run.state == "starting"

"""When a run may start (sql/006_lifecycle.sql): one live run per concurrency key, in submission
order, across concurrent claims; not_before; start_deadline and the `expired` state; resume and
cancel of such runs; the reasons a waiting or expired run gives."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta

import psycopg
import pytest

from supervisor import store
from supervisor.model import Attempt
from supervisor.outcomes import Outcome
from tests.integration.conftest import age_jobs, fence_of, register, run_concurrently, wait_notifies
from tests.integration.test_claim import FAILED, SUCCEEDED, claim, claimed_ids, settle, submit

# Each test runs twice: as the superuser, and with the store's calls made as bound host roles and as a
# submitter (tests/integration/conftest.py, as_bound_roles).
pytestmark = pytest.mark.usefixtures("as_bound_roles")

START_FAILED = Outcome("start-failed", None, "the unit did not start")


def state(conn: psycopg.Connection, run_id: uuid.UUID) -> str:
    return conn.execute("SELECT state FROM unitvisor.runs WHERE id = %s", (run_id,)).fetchone()[0]


def started(conn: psycopg.Connection, attempt: Attempt) -> None:
    store.mark_started(conn, fence_of(conn, attempt.host_id), attempt, f"inv-{attempt.run_id.hex[:8]}")


def finish(conn: psycopg.Connection, attempt: Attempt) -> None:
    started(conn, attempt)
    assert settle(conn, attempt, SUCCEEDED, "succeeded")


def pass_deadline(conn: psycopg.Connection, run_id: uuid.UUID) -> None:
    """Move a run's start deadline (and its not_before, which must stay before it) into the past."""
    conn.execute("UPDATE unitvisor.runs SET not_before = NULL, start_deadline = now() - interval '1 second' "
                 "WHERE id = %s", (run_id,))


def expire(conn: psycopg.Connection, host: str = "h1") -> int:
    return store.expire_runs(conn, register(conn, host))


def last_event(conn: psycopg.Connection, run_id: uuid.UUID) -> tuple[str, str]:
    row = store.get_events(conn, run_id, limit=1)[0]
    return row["state"], row["reason"]


# -- one live run per key ---------------------------------------------------------------------------


def test_runs_of_one_key_start_one_at_a_time_in_submission_order(conn: psycopg.Connection) -> None:
    first, second, third = (submit(conn, concurrency_key="nightly") for _ in range(3))
    other = submit(conn, concurrency_key="hourly")
    free = submit(conn)
    age_jobs(conn)
    pairs = claim(conn)
    assert claimed_ids(pairs) == {first, other, free}
    assert claim(conn) == []
    attempts = {a.run_id: a for _, a in pairs}
    started(conn, attempts[first])
    assert claim(conn) == []  # running holds the key as starting did
    assert settle(conn, attempts[first], SUCCEEDED, "succeeded")
    [(_, second_attempt)] = claim(conn)
    assert second_attempt.run_id == second
    assert settle(conn, second_attempt, FAILED, "failed")  # a failed run frees the key as well
    assert claimed_ids(claim(conn)) == {third}


def test_priority_does_not_overtake_within_a_key(conn: psycopg.Connection) -> None:
    first = submit(conn, concurrency_key="k", priority=0)
    submit(conn, concurrency_key="k", priority=100)
    age_jobs(conn)
    assert claimed_ids(claim(conn)) == {first}


def test_a_cancelled_run_does_not_hold_its_key_nor_an_expired_one(conn: psycopg.Connection) -> None:
    """An overdue run holds its key until the fleet upkeep expires it, the one place that does
    (sql/012_expiry_owner.sql says why the claim does not look past it)."""
    first = submit(conn, concurrency_key="k", start_deadline="2100-01-01Z")
    second = submit(conn, concurrency_key="k")
    third = submit(conn, concurrency_key="k")
    assert store.cancel_run(conn, first).state == "cancelled"
    pass_deadline(conn, second)
    age_jobs(conn)
    assert claim(conn) == []  # third waits for second, which the claim neither takes nor expires
    assert state(conn, second) == "queued"
    assert expire(conn) == 1
    assert state(conn, second) == "expired"
    assert claimed_ids(claim(conn)) == {third}


def test_a_queued_retry_keeps_its_place_ahead_of_later_runs(conn: psycopg.Connection) -> None:
    first = submit(conn, concurrency_key="k", max_attempts=2)
    second = submit(conn, concurrency_key="k")
    age_jobs(conn)
    [(_, attempt)] = claim(conn)
    started(conn, attempt)
    assert settle(conn, attempt, FAILED, "queued", timedelta(0))
    assert state(conn, first) == "queued"
    age_jobs(conn)
    [(_, retry)] = claim(conn)
    assert (retry.run_id, retry.attempt) == (first, 2)
    finish(conn, retry)
    assert claimed_ids(claim(conn)) == {second}


def test_a_retry_in_its_backoff_holds_back_the_later_runs(conn: psycopg.Connection) -> None:
    submit(conn, concurrency_key="k", max_attempts=2)
    submit(conn, concurrency_key="k")
    age_jobs(conn)
    [(_, attempt)] = claim(conn)
    started(conn, attempt)
    assert settle(conn, attempt, FAILED, "queued", timedelta(hours=1))
    assert claim(conn) == []


def test_the_key_is_decided_under_a_lock_a_concurrent_claim_cannot_see_past(conn: psycopg.Connection,
                                                                           dsn: str) -> None:
    # h1 claims the first run of the key and has not committed. A run of the same key that sorts
    # before it then appears (committed): h2's snapshot sees it as the first queued run and no run
    # starting, which is exactly the stale view the key's lock exists for. h2 must skip it, at once.
    first = submit(conn, concurrency_key="k")
    earlier = submit(conn, concurrency_key="k")
    age_jobs(conn)
    conn.execute("UPDATE unitvisor.runs SET created_at = created_at + interval '1 hour' WHERE id = %s", (earlier,))
    with store.connect(dsn) as other:
        other.execute("SET statement_timeout = '10s'")
        register(conn, "h1")
        register(other, "h2")
        with conn.transaction():
            assert claimed_ids(claim(conn, "h1")) == {first}
            conn2 = psycopg.connect(dsn, autocommit=True)
            try:
                conn2.execute("UPDATE unitvisor.runs SET created_at = created_at - interval '2 hours' WHERE id = %s",
                              (earlier,))
            finally:
                conn2.close()
            assert claim(other, "h2") == []
        assert claim(other, "h2") == []  # now it sees the first run starting
    live = conn.execute("SELECT count(*) FROM unitvisor.runs WHERE concurrency_key = 'k' "
                        "AND state IN ('starting', 'running')").fetchone()[0]
    assert live == 1


def test_concurrent_claims_never_start_two_runs_of_one_key(conn: psycopg.Connection, dsn: str) -> None:
    total = 30
    ids = [submit(conn, concurrency_key="shared") for _ in range(total)]
    age_jobs(conn)
    barrier = threading.Barrier(2)
    order: list[uuid.UUID] = []
    lock = threading.Lock()

    def worker(host: str) -> None:
        with store.connect(dsn) as c:
            c.execute("SET statement_timeout = '30s'")
            barrier.wait(timeout=10)
            while True:
                with c.transaction():
                    pairs = claim(c, host=host, batch=5)
                    time.sleep(0.002)  # the other claims meanwhile, against these locks
                for _, attempt in pairs:
                    with lock:
                        order.append(attempt.run_id)
                        live = c.execute("SELECT count(*) FROM unitvisor.runs WHERE concurrency_key = 'shared' "
                                         "AND state IN ('starting', 'running')").fetchone()[0]
                        assert live == 1, f"{live} runs of one key live at once"
                    finish(c, attempt)
                if not pairs and c.execute("SELECT count(*) FROM unitvisor.runs WHERE state = 'queued'"
                                           ).fetchone()[0] == 0:
                    return

    run_concurrently(worker, ("h1", "h2"))
    assert order == ids  # each once, in submission order


def test_the_unique_index_refuses_a_second_live_run_of_a_key(conn: psycopg.Connection) -> None:
    first, second = submit(conn, concurrency_key="k"), submit(conn, concurrency_key="k")
    age_jobs(conn)
    claim(conn)
    with pytest.raises(psycopg.errors.UniqueViolation):
        conn.execute("UPDATE unitvisor.runs SET state = 'running' WHERE id = %s", (second,))
    assert state(conn, first) == "starting"


def test_a_waiting_run_names_the_run_of_its_key_it_waits_for(conn: psycopg.Connection) -> None:
    first = submit(conn, concurrency_key="k")
    second = submit(conn, concurrency_key="k")
    third = submit(conn, concurrency_key="k", host_pin="nowhere")
    register(conn, "h1")
    age_jobs(conn)
    store.explain_waiting(conn, timedelta(0))
    assert store.run_status(conn, first).wait_reason is None
    assert store.run_status(conn, second).wait_reason == (
        f"waits for run {first} (queued) with the same concurrency key")
    assert store.run_status(conn, third).wait_reason == (
        f"waits for run {second} (queued) with the same concurrency key; pinned to host nowhere, "
        "which is not known (see unitvisor hosts)")
    claim(conn)
    store.explain_waiting(conn, timedelta(0))
    assert store.run_status(conn, second).wait_reason == (
        f"waits for run {first} (starting) with the same concurrency key")
    assert last_event(conn, second) == (
        "queued", f"waiting: waits for run {first} (starting) with the same concurrency key")


# -- not_before -------------------------------------------------------------------------------------


def test_not_before_delays_the_first_start(conn: psycopg.Connection) -> None:
    later = submit(conn, not_before="2100-01-01 00:00Z")
    scheduled = conn.execute("SELECT scheduled_at = %s::timestamptz FROM unitvisor.spawn_jobs WHERE run_id = %s",
                             ("2100-01-01 00:00Z", later)).fetchone()[0]
    assert scheduled
    register(conn, "h1")
    assert claim(conn) == []
    status = store.run_status(conn, later)
    assert status.wait_reason == "not before 2100-01-01 00:00:00 UTC"
    assert store.get_run(conn, later).wait_reason == status.wait_reason
    conn.execute("UPDATE unitvisor.spawn_jobs SET scheduled_at = now() - interval '1 minute' WHERE run_id = %s",
                 (later,))
    conn.execute("UPDATE unitvisor.runs SET not_before = now() - interval '1 minute' WHERE id = %s", (later,))
    assert claimed_ids(claim(conn)) == {later}


def test_a_not_before_in_the_past_is_now(conn: psycopg.Connection) -> None:
    run_id = submit(conn, not_before="2000-01-01Z")
    age_jobs(conn)
    assert claimed_ids(claim(conn)) == {run_id}


def test_a_retry_keeps_its_backoff_not_the_not_before(conn: psycopg.Connection) -> None:
    run_id = submit(conn, not_before="2000-01-01Z", max_attempts=2)
    age_jobs(conn)
    [(_, attempt)] = claim(conn)
    started(conn, attempt)
    assert settle(conn, attempt, FAILED, "queued", timedelta(seconds=30))
    due_in = conn.execute("SELECT extract(epoch FROM scheduled_at - now()) FROM unitvisor.spawn_jobs "
                          "WHERE run_id = %s AND state = 'available'", (run_id,)).fetchone()[0]
    assert 0 < due_in <= 30


# -- start_deadline and expired ---------------------------------------------------------------------


def test_a_run_no_host_takes_expires_at_its_deadline(conn: psycopg.Connection, dsn: str) -> None:
    run_id = submit(conn, host_pin="nowhere", start_deadline="2100-01-01Z")
    register(conn, "h1")
    age_jobs(conn)
    store.explain_waiting(conn, timedelta(0))
    assert expire(conn) == 0
    pass_deadline(conn, run_id)
    with store.connect(dsn) as listening:
        store.listen(listening, "unitvisor_run_finished")
        assert expire(conn) == 1
        notes = wait_notifies(listening)
    assert [n.payload for n in notes] == [f'{{"run_id" : "{run_id}", "state" : "expired"}}']
    run = store.get_run(conn, run_id)
    assert run.state == "expired" and run.finished_at is not None and run.wait_reason is None
    assert conn.execute("SELECT count(*) FROM unitvisor.spawn_jobs WHERE run_id = %s AND state = 'available'",
                        (run_id,)).fetchone()[0] == 0
    assert conn.execute("SELECT count(*) FROM unitvisor.run_waits WHERE run_id = %s", (run_id,)).fetchone()[0] == 0
    kind, reason = last_event(conn, run_id)
    assert kind == "expired"
    assert reason.startswith("not started by its start deadline ")
    assert reason.endswith("; it was waiting for pinned to host nowhere, which is not known (see unitvisor hosts)")
    status = store.run_status(conn, run_id)
    assert (status.state, status.outcome, status.reason, status.attempts) == ("expired", "expired", reason, 0)
    assert expire(conn) == 0  # once


def test_a_run_waiting_for_its_key_expires_naming_the_run(conn: psycopg.Connection) -> None:
    first = submit(conn, concurrency_key="k")
    second = submit(conn, concurrency_key="k", start_deadline="2100-01-01Z")
    age_jobs(conn)
    claim(conn)
    pass_deadline(conn, second)
    assert expire(conn) == 1
    assert last_event(conn, second)[1].endswith(
        f"it was waiting for run {first} (starting) with the same concurrency key")


def test_a_claim_never_starts_a_run_past_its_deadline_and_leaves_its_expiry_to_the_upkeep(
        conn: psycopg.Connection) -> None:
    """The upkeep is the one caller that expires runs, so that the daemons count every expiry
    (sql/012_expiry_owner.sql): the claim leaves an overdue run as it is, and the heartbeat asks for
    the upkeep instead of offering the run as work."""
    run_id = submit(conn, start_deadline="2100-01-01Z")
    age_jobs(conn)
    pass_deadline(conn, run_id)
    fence = register(conn, "h1")
    idle = store.probe(conn, fence, timedelta(hours=1))  # no job due for long, no silent host
    assert (idle.claimable, idle.upkeep) == (False, True)
    assert claim(conn) == []
    assert state(conn, run_id) == "queued"
    assert expire(conn) == 1
    assert state(conn, run_id) == "expired"
    assert last_event(conn, run_id)[1].endswith("it was waiting for a host to claim it")
    assert store.probe(conn, fence, timedelta(hours=1)).upkeep is False


def test_retries_past_their_deadline_do_not_hide_an_overdue_run_from_expiry(conn: psycopg.Connection) -> None:
    """expire_overdue_runs takes its batch among the runs it may expire: as many retries past their
    deadline (started once, so never expired) as the batch holds, ahead of an overdue run, left it
    unexpired for good before 012, while the heartbeat asked for an upkeep every poll."""
    retries = [submit(conn, start_deadline="2100-01-01Z", max_attempts=2) for _ in range(2)]
    age_jobs(conn)
    for _, attempt in claim(conn):
        started(conn, attempt)
        assert settle(conn, attempt, FAILED, "queued", timedelta(hours=1))
    conn.execute("UPDATE unitvisor.runs SET start_deadline = now() - interval '1 minute' WHERE id = ANY(%s)",
                 (retries,))
    overdue = submit(conn, start_deadline="2100-01-01Z")
    pass_deadline(conn, overdue)  # later than the retries' deadlines: last in deadline order
    assert conn.execute("SELECT unitvisor.expire_overdue_runs(2)").fetchone() == (1,)
    assert state(conn, overdue) == "expired"
    assert {state(conn, r) for r in retries} == {"queued"}


def test_a_retry_queued_past_its_deadline_does_not_keep_asking_for_the_upkeep(conn: psycopg.Connection) -> None:
    """A run that started once is never expired, so its passed deadline is no reason for an upkeep: the
    heartbeat's flag asks is_overdue, not the deadline alone."""
    run_id = submit(conn, start_deadline="2100-01-01Z", max_attempts=2)
    age_jobs(conn)
    [(_, attempt)] = claim(conn)
    started(conn, attempt)
    assert settle(conn, attempt, FAILED, "queued", timedelta(hours=1))
    pass_deadline(conn, run_id)
    probe = store.probe(conn, register(conn, "h1"), timedelta(hours=1))
    assert (probe.claimable, probe.upkeep) == (False, False)  # its retry is not due for an hour


def test_a_run_claimed_before_its_deadline_is_not_expired(conn: psycopg.Connection) -> None:
    run_id = submit(conn, start_deadline="2100-01-01Z")
    age_jobs(conn)
    [(_, attempt)] = claim(conn)
    pass_deadline(conn, run_id)
    assert expire(conn) == 0
    started(conn, attempt)
    assert state(conn, run_id) == "running"


def test_a_run_that_started_is_retried_past_its_deadline(conn: psycopg.Connection) -> None:
    run_id = submit(conn, start_deadline="2100-01-01Z", max_attempts=2)
    age_jobs(conn)
    [(_, attempt)] = claim(conn)
    started(conn, attempt)
    assert settle(conn, attempt, FAILED, "queued", timedelta(0))
    pass_deadline(conn, run_id)
    assert expire(conn) == 0
    age_jobs(conn)
    [(_, retry)] = claim(conn)
    assert (retry.run_id, retry.attempt) == (run_id, 2)


def test_a_run_whose_attempts_never_started_expires_with_them_in_its_reason(conn: psycopg.Connection) -> None:
    run_id = submit(conn, start_deadline="2100-01-01Z", max_attempts=2)
    age_jobs(conn)
    [(_, attempt)] = claim(conn)
    assert settle(conn, attempt, START_FAILED, "queued", timedelta(hours=1))
    pass_deadline(conn, run_id)
    assert expire(conn) == 1
    reason = last_event(conn, run_id)[1]
    assert reason.endswith("it was waiting for 1 attempt(s), none of which started; the last: start-failed "
                           "(the unit did not start)")
    status = store.run_status(conn, run_id)
    assert (status.state, status.attempt, status.outcome, status.reason) == ("expired", 1, "expired", reason)


def test_expiry_skips_a_run_whose_job_is_being_claimed(conn: psycopg.Connection, dsn: str) -> None:
    run_id = submit(conn, start_deadline="2100-01-01Z")
    age_jobs(conn)
    with store.connect(dsn) as other:
        other.execute("SET statement_timeout = '10s'")
        register(other, "h2")
        with other.transaction():
            other.execute("SELECT 1 FROM unitvisor.spawn_jobs WHERE run_id = %s FOR UPDATE", (run_id,))
            pass_deadline(conn, run_id)
            assert expire(conn) == 0  # and did not wait
    assert expire(conn) == 1


def test_cancel_of_an_expired_run_changes_nothing(conn: psycopg.Connection) -> None:
    run_id = submit(conn, start_deadline="2100-01-01Z")
    pass_deadline(conn, run_id)
    expire(conn)
    result = store.cancel_run(conn, run_id)
    assert (result.state, result.changed) == ("expired", False)


def test_resume_of_an_expired_run_drops_the_passed_deadline(conn: psycopg.Connection) -> None:
    run_id = submit(conn, start_deadline="2100-01-01Z")
    pass_deadline(conn, run_id)
    expire(conn)
    result = store.resume_run(conn, run_id)
    assert (result.state, result.changed) == ("queued", True)
    run = store.get_run(conn, run_id)
    assert run.start_deadline is None and run.finished_at is None
    kind, reason = last_event(conn, run_id)
    assert kind == "queued" and reason.startswith("resumed by an operator; its start deadline ")
    assert reason.endswith(" has passed and no longer applies")
    age_jobs(conn)
    assert claimed_ids(claim(conn)) == {run_id}


def test_resume_keeps_a_deadline_ahead_and_the_not_before(conn: psycopg.Connection) -> None:
    run_id = submit(conn, not_before="2099-01-01Z", start_deadline="2100-01-01Z")
    store.cancel_run(conn, run_id)
    assert store.resume_run(conn, run_id).changed
    run = store.get_run(conn, run_id)
    assert run.start_deadline is not None
    assert last_event(conn, run_id) == ("queued", "resumed by an operator")
    register(conn, "h1")
    assert claim(conn) == []  # its job is due at its not_before, as at submit
    assert conn.execute("SELECT scheduled_at = %s::timestamptz FROM unitvisor.spawn_jobs "
                        "WHERE run_id = %s AND state = 'available'", ("2099-01-01Z", run_id)).fetchone()[0]


# -- submit_run's signature ------------------------------------------------------------------------


def test_the_new_arguments_are_stored(conn: psycopg.Connection) -> None:
    run_id = submit(conn, concurrency_key="k", not_before="2099-01-01Z", start_deadline="2100-01-01Z")
    run = store.get_run(conn, run_id)
    assert run.concurrency_key == "k"
    assert (run.not_before.year, run.start_deadline.year) == (2099, 2100)


def test_calls_written_for_schema_5_still_work(conn: psycopg.Connection) -> None:
    # 0.3.0's store.submit_run names its arguments; a control plane may pass all 18 by position.
    positional = conn.execute(
        "SELECT unitvisor.submit_run(ARRAY['/bin/true'], '{}'::jsonb, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 1, "
        "NULL, 0, 10, 600, NULL, false, 'idem-1', '{\"a\": \"b\"}'::jsonb)").fetchone()[0]
    named = conn.execute("SELECT unitvisor.submit_run(argv => ARRAY['/bin/true'], labels => '{}'::jsonb, "
                         "idempotency_key => 'idem-2')").fetchone()[0]
    for run_id in (positional, named):
        run = store.get_run(conn, run_id)
        assert (run.concurrency_key, run.not_before, run.start_deadline, run.state) == (None, None, None, "queued")


def test_a_retried_submit_finds_its_run_after_the_deadline_passed(conn: psycopg.Connection) -> None:
    run_id = submit(conn, idempotency_key="once", start_deadline="2100-01-01Z")
    conn.execute("UPDATE unitvisor.runs SET start_deadline = now() - interval '1 second' WHERE id = %s", (run_id,))
    assert submit(conn, idempotency_key="once", start_deadline="2000-01-01Z") == run_id

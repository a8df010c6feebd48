"""The claim latency's definition (supervisor/metrics.claim_latency) against the real claim: the run a
claim returns is as it was before the claim moved it (its updated_at is when it was queued), and its
attempt's claimed_at is the claim's own time, both by the database's clock."""

from __future__ import annotations

from datetime import timedelta

import psycopg

from supervisor import store, unitspec
from supervisor.metrics import claim_latency
from supervisor.outcomes import Outcome
from tests.integration.conftest import fence_of, register


def queued_ago(conn: psycopg.Connection, seconds: float) -> None:
    """Pretend every queued run was queued, and its job due, `seconds` ago."""
    conn.execute("UPDATE unitvisor.runs SET updated_at = now() - make_interval(secs => %s) WHERE state = 'queued'",
                 (seconds,))
    conn.execute("UPDATE unitvisor.spawn_jobs SET scheduled_at = now() - make_interval(secs => %s) "
                 "WHERE state = 'available'", (seconds,))


def test_a_first_attempt_is_measured_from_queued_to_claimed(conn: psycopg.Connection) -> None:
    run_id = store.submit_run(conn, argv=["/bin/true"])
    queued_ago(conn, 30)
    [(run, attempt)] = store.claim(conn, register(conn, "h1"), 10, unitspec.UNIT_NAME_FORMAT)
    assert run.id == run_id and attempt.attempt == 1
    latency = claim_latency(run, attempt)
    assert latency is not None and 30 <= latency < 60  # not the claim's own update of the run (0)


def test_a_fresh_run_claimed_at_once_has_a_small_latency(conn: psycopg.Connection) -> None:
    store.submit_run(conn, argv=["/bin/true"])
    conn.execute("UPDATE unitvisor.spawn_jobs SET scheduled_at = now() - interval '10 s'")  # past the spread grace
    [(run, attempt)] = store.claim(conn, register(conn, "h1"), 10, unitspec.UNIT_NAME_FORMAT)
    assert run.updated_at == run.created_at  # submitted: queued when created
    latency = claim_latency(run, attempt)
    assert latency is not None and 0 <= latency < 10


def test_a_retry_is_left_out(conn: psycopg.Connection) -> None:
    store.submit_run(conn, argv=["/bin/true"], max_attempts=2)
    queued_ago(conn, 10)
    [(_, first)] = store.claim(conn, register(conn, "h1"), 10, unitspec.UNIT_NAME_FORMAT)
    assert store.record_outcome(conn, fence_of(conn, "h1"), first, Outcome("exit-code", "exit:1", "exited 1"),
                                "queued", timedelta(0))  # retried at once
    queued_ago(conn, 10)
    [(run, second)] = store.claim(conn, register(conn, "h1"), 10, unitspec.UNIT_NAME_FORMAT)
    assert second.attempt == 2
    assert claim_latency(run, second) is None

"""Failure rules (issue 25, item 3; sql/migrations/027_failure_rules.sql) against the real schema:
retry_on's exit statuses and signals, fail_on, count_lost and max_lost_attempts; each refused value
named; the database's decision whatever a writer proposes (a 0.8.0 daemon's, a peer's); and the
SQL decision equal to its Python twin over the whole table of tests/unit/test_failure_rules.py.

Each test here failed before 027: submit_run had no fail_on, count_lost or max_lost_attempts, and
retry_on refused `exit:75`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from supervisor import store, unitspec
from supervisor.model import Attempt
from supervisor.outcomes import Outcome, failure_verdict
from tests.harness.host import REPO
from tests.harness.postgres import Postgres
from tests.integration.conftest import connected, register, silence
from tests.integration.test_sql_api_example import assert_example_prints_its_out
from tests.unit.test_failure_rules import ENDINGS, POLICIES, run

pytestmark = pytest.mark.usefixtures("as_bound_roles")

FMT = unitspec.UNIT_NAME_FORMAT
LOST = Outcome("lost", None, "host h1 was declared dead")


def started(conn: psycopg.Connection, fence: store.Fence, **values: Any) -> tuple[uuid.UUID, Attempt]:
    run_id = store.submit_run(conn, argv=["/bin/true"], **values)
    return run_id, claimed(conn, fence, run_id)


def claimed(conn: psycopg.Connection, fence: store.Fence, run_id: uuid.UUID) -> Attempt:
    conn.execute("UPDATE unitvisor.spawn_jobs SET scheduled_at = now() WHERE run_id = %s", (run_id,))
    [(_, attempt)] = store.claim(conn, fence, 1, FMT)
    assert attempt.run_id == run_id
    store.mark_started(conn, fence, attempt, f"inv-{run_id.hex[:8]}-{attempt.attempt}")
    return attempt


def last_event(conn: psycopg.Connection, run_id: uuid.UUID) -> str:
    return store.get_events(conn, run_id)[-1]["reason"]


def refused(conn: psycopg.Connection, message: str, **values: Any) -> None:
    with pytest.raises(store.DatabaseError, match=message):
        store.submit_run(conn, argv=["/bin/true"], **values)
    conn.rollback()


# -- every value checked, by name ------------------------------------------------------------------


@pytest.mark.parametrize(("values", "message"), [
    ({"retry_on": ["exit:256"]}, r"retry_on: exit:256 is no exit status \(exit:1 to exit:255; exit:0 is success\)"),
    ({"retry_on": ["exit:0"]}, "retry_on: exit:0 is no exit status"),
    ({"fail_on": ["exit:-1"]}, "fail_on: exit:-1: may hold only exit:N"),
    ({"retry_on": ["signal:FOO"]}, "retry_on: signal:FOO names no signal"),
    ({"fail_on": ["signal:9"]}, "fail_on: signal:9 names no signal"),
    ({"retry_on": ["exit-code", ""]}, "retry_on: element 2 is empty"),
    ({"fail_on": [""]}, "fail_on: element 1 is empty"),
    ({"retry_on": ["crashed"]}, "retry_on: crashed: may hold only exit-code, signal, core-dump"),
    ({"fail_on": ["exit-code"]}, r"fail_on: exit-code: may hold only exit:N \(1 to 255\) and signal:NAME"),
    ({"retry_on": ["exit:3"], "fail_on": ["exit:3"]}, "fail_on: exit:3 is in retry_on too"),
    # one list says SIGTERM, the other TERM: the same signal, refused the same way once normalised
    ({"retry_on": ["signal:SIGTERM"], "fail_on": ["signal:term"]}, "fail_on: signal:TERM is in retry_on too"),
    ({"fail_on": ["exit:3"] * 65}, "fail_on: 65 elements, over the limit of 64"),
    ({"retry_on": ["lost"] * 65}, "retry_on: 65 elements, over the limit of 64"),
    ({"max_lost_attempts": 0}, r"max_lost_attempts: 0 is out of range \(1 to 1000\)"),
    ({"max_lost_attempts": 1001}, "max_lost_attempts: 1001 is out of range"),
])
def test_bad_values_are_refused_by_name(conn: psycopg.Connection, values: dict[str, Any], message: str) -> None:
    refused(conn, message, **values)
    assert conn.execute("SELECT count(*) FROM unitvisor.runs").fetchone()[0] == 0


def test_a_null_count_lost_is_refused_by_name(conn: psycopg.Connection) -> None:
    with pytest.raises(psycopg.errors.NotNullViolation, match="count_lost: must not be NULL"):
        conn.execute("SELECT unitvisor.submit_run(ARRAY['/bin/true'], count_lost => NULL)")


def test_signal_names_are_kept_in_one_spelling(conn: psycopg.Connection) -> None:
    run_id = store.submit_run(conn, argv=["/bin/true"], retry_on=["signal:SIGTERM", "exit:75", "lost"],
                              fail_on=["signal:kill", "signal:SIGsegv"])
    row = store.get_run(conn, run_id)
    assert (row.retry_on, row.fail_on) == (["signal:TERM", "exit:75", "lost"], ["signal:KILL", "signal:SEGV"])
    assert (row.count_lost, row.max_lost_attempts) == (False, 3)


def test_a_row_written_another_way_is_checked_too(conn: psycopg.Connection) -> None:
    """The table's trigger asks the same checks (an admin's UPDATE): the spelling it keeps, no other."""
    run_id = store.submit_run(conn, argv=["/bin/true"])
    with pytest.raises(psycopg.errors.CheckViolation, match="fail_on: signal:SIGTERM names no signal"):
        conn.execute("UPDATE unitvisor.runs SET fail_on = '{signal:SIGTERM}' WHERE id = %s", (run_id,))


# -- the database decides, whatever the writer proposed -------------------------------------------


def test_exit_75_is_retried_by_retry_on_exit_75(conn: psycopg.Connection) -> None:
    """The daemon of 0.8.0 knows no exit:75 and proposes `failed`: the database retries it."""
    h1 = register(conn, "h1")
    run_id, first = started(conn, h1, max_attempts=3, retry_on=["exit:75"], retry_backoff_sec=0)
    assert store.record_outcome(conn, h1, first, Outcome("exit-code", "exit:75", "exited with status 75"), "failed")
    assert store.get_run(conn, run_id).state == "queued"
    second = claimed(conn, h1, run_id)
    assert store.record_outcome(conn, h1, second, Outcome("exit-code", "exit:3", "exited with status 3"), "failed")
    assert store.get_run(conn, run_id).state == "failed"  # exit 3 is not in retry_on


def test_fail_on_ends_the_run_at_once_with_attempts_left(conn: psycopg.Connection) -> None:
    h1 = register(conn, "h1")
    run_id, first = started(conn, h1, max_attempts=5, fail_on=["exit:3"])
    # A daemon that knows no fail_on (0.8.0) proposes a retry: the database ends the run.
    assert store.record_outcome(conn, h1, first, Outcome("exit-code", "exit:3", "exited with status 3"), "queued",
                                timedelta(0))
    run = store.get_run(conn, run_id)
    assert (run.state, run.finished_at is not None) == ("failed", True)
    assert last_event(conn, run_id) == "attempt 1: exit-code (exited with status 3); no retry: fail_on names exit:3"
    assert conn.execute("SELECT count(*) FROM unitvisor.spawn_jobs WHERE run_id = %s AND state = 'available'",
                        (run_id,)).fetchone()[0] == 0


def test_fail_on_a_signal(conn: psycopg.Connection) -> None:
    h1 = register(conn, "h1")
    run_id, first = started(conn, h1, max_attempts=5, fail_on=["signal:KILL"])
    assert store.record_outcome(conn, h1, first, Outcome("signal", "signal:KILL", "killed by signal KILL"), "queued",
                                timedelta(0))
    assert store.get_run(conn, run_id).state == "failed"
    assert last_event(conn, run_id).endswith("no retry: fail_on names signal:KILL")


@contextmanager
def dead_h1(conn: psycopg.Connection, dsn: str) -> Iterator[tuple[psycopg.Connection, store.Fence]]:
    """h1 silent and declared dead by h2 (another session); yields h2's connection and fence."""
    with store.connect(dsn) as other:
        other.execute("SET statement_timeout = '10s'")
        h2 = register(other, "h2")
        connected(conn, "h2")
        silence(conn, "h1", 120)
        assert [d.host_id for d in store.declare_dead_hosts(other, h2, 3600)] == ["h1"]
        yield other, h2
        # h2's host lock goes with its session, but a closed connection's backend ends after the close
        # returns: the next dead_h1's h2 found it still held once (the trixie pass, loaded). Released here.
        other.execute("SELECT pg_advisory_unlock_all()")


def revive(conn: psycopg.Connection) -> store.Fence:
    """h1 registers again (a new instance, after its reboot) and may claim."""
    conn.execute("UPDATE unitvisor.hosts SET heartbeat_at = now() WHERE id = 'h1'")
    return register(conn, "h1", instance=f"after-{uuid.uuid4().hex[:6]}")


def test_a_lost_attempt_does_not_count_unless_the_run_says_so(conn: psycopg.Connection, dsn: str) -> None:
    """A host declared dead: its peer settles each open attempt lost, proposing what a 0.8.0 daemon
    would (failed: max_attempts 1 is used up), and the database decides by each run's policy."""
    h1 = register(conn, "h1")
    free, free_attempt = started(conn, h1)
    counted, counted_attempt = started(conn, h1, count_lost=True)
    with dead_h1(conn, dsn) as (other, h2):
        assert store.record_outcome(other, h2, free_attempt, LOST, "failed")
        assert store.record_outcome(other, h2, counted_attempt, LOST, "failed")
    assert store.get_run(conn, free).state == "queued"
    assert "lost with its host, not counted against max_attempts (1 of max_lost_attempts 3)" in last_event(conn, free)
    assert store.get_run(conn, counted).state == "failed"


def test_a_run_that_kills_its_hosts_ends_at_max_lost_attempts(conn: psycopg.Connection, dsn: str) -> None:
    h1 = register(conn, "h1")
    # avoid_failed_host false: the retry goes back to h1 at once (033 would make it wait 60 s for another host).
    run_id, attempt = started(conn, h1, max_lost_attempts=2, retry_backoff_sec=0, avoid_failed_host=False)
    with dead_h1(conn, dsn) as (other, h2):
        # The peer proposes a retry each time; the second loss reaches the cap.
        assert store.record_outcome(other, h2, attempt, LOST, "queued", timedelta(0))
        assert store.get_run(conn, run_id).state == "queued"
        h1 = revive(conn)
        attempt = claimed(conn, h1, run_id)
    with dead_h1(conn, dsn) as (other, h2):
        assert store.record_outcome(other, h2, attempt, LOST, "queued", timedelta(0))
    run = store.get_run(conn, run_id)
    assert (run.state, run.lost_attempts) == ("failed", 2)
    assert last_event(conn, run_id).endswith("no retry: max_lost_attempts reached (2 attempts lost with their host)")


def test_a_retry_the_writer_did_not_propose_waits_the_runs_backoff(conn: psycopg.Connection) -> None:
    h1 = register(conn, "h1")
    run_id, first = started(conn, h1, max_attempts=2, retry_on=["exit:75"], retry_backoff_sec=100)
    assert store.record_outcome(conn, h1, first, Outcome("exit-code", "exit:75", "exited with status 75"), "failed")
    due = conn.execute("SELECT extract(epoch FROM scheduled_at - now()) FROM unitvisor.spawn_jobs "
                       "WHERE run_id = %s AND state = 'available'", (run_id,)).fetchone()[0]
    assert 49 <= due <= 100  # 100 s jittered into [half, all]
    assert "retry in" in last_event(conn, run_id)


# -- the SQL decision is its Python twin's --------------------------------------------------------


def test_the_database_decides_as_the_daemon_over_the_whole_table(conn: psycopg.Connection) -> None:
    """unitvisor.failure_verdict and outcomes.failure_verdict, over every case of the unit test's table,
    in one statement per policy."""
    differ = []
    for retry_on, fail_on, count_lost, cancelled in POLICIES:
        policy = run(retry_on, fail_on, count_lost, cancelled)
        rows = conn.execute(
            """SELECT (unitvisor.failure_verdict(%s, %s, %s, %s, %s, %s, e.attempt, e.lost, e.outcome, e.status)).*
               FROM unnest(%s::text[], %s::text[], %s::int[], %s::int[]) WITH ORDINALITY
                    AS e(outcome, status, attempt, lost, i) ORDER BY e.i""",
            (policy.max_attempts, policy.retry_on, policy.fail_on, count_lost, policy.max_lost_attempts, cancelled,
             [e[0] for e in ENDINGS], [e[1] for e in ENDINGS], [e[2] for e in ENDINGS],
             [e[3] for e in ENDINGS])).fetchall()
        for (outcome, status, attempt, lost), (retry, why) in zip(ENDINGS, rows, strict=True):
            python = failure_verdict(policy, attempt, lost, outcome, status)
            if (python.retry, python.why) != (retry, why):
                differ.append((retry_on, fail_on, count_lost, cancelled, outcome, status, attempt, lost,
                               (retry, why), python))
    assert not differ, f"{len(differ)} cases differ, the first: {differ[:3]}"


# -- the documented example --------------------------------------------------------------------------

EXAMPLE = REPO / "docs" / "examples" / "failure_rules.sql"


def test_the_documented_example_runs_and_prints_what_the_docs_show(postgres: Postgres,
                                                                    conn: psycopg.Connection) -> None:
    """docs/examples/failure_rules.sql, as test_sql_api_example does for sql_api.sql."""
    assert_example_prints_its_out(postgres, conn.info.dbname, EXAMPLE)
    assert conn.execute("SELECT state FROM unitvisor.runs").fetchall() == [("cancelled",)]


# -- the CLI -------------------------------------------------------------------------------------------


def test_the_cli_submits_the_rules_and_show_says_which_attempts_did_not_count(cli, dsn: str,
                                                                              conn: psycopg.Connection) -> None:
    result = cli("submit", "--max-attempts", "2", "--retry-on", "exit:75", "--retry-on", "lost",
                 "--fail-on", "signal:SIGKILL", "--max-lost-attempts", "4", "--", "/bin/true", dsn=dsn)
    assert result.returncode == 0, result.stderr
    run_id = uuid.UUID(result.stdout.strip().splitlines()[0])
    run = store.get_run(conn, run_id)
    assert (run.retry_on, run.fail_on, run.count_lost, run.max_lost_attempts) == (
        ["exit:75", "lost"], ["signal:KILL"], False, 4)
    # Refused by the database, named.
    bad = cli("submit", "--retry-on", "exit:3", "--fail-on", "exit:3", "--", "/bin/true", dsn=dsn)
    assert bad.returncode != 0 and "fail_on: exit:3 is in retry_on too" in bad.stderr

    # Its first attempt lost with web-2, declared dead; the second runs.
    h1 = register(conn, "web-2")
    attempt = claimed(conn, h1, run_id)
    conn.execute("UPDATE unitvisor.hosts SET state = 'dead' WHERE id = 'web-2'")
    h2 = register(conn, "web-3")
    assert store.record_outcome(conn, h2, attempt, LOST, "failed")
    claimed(conn, h2, run_id)

    shown = cli("show", str(run_id), dsn=dsn)
    assert shown.returncode == 0, shown.stderr
    assert "  attempt 1 (lost with host web-2, not counted): host=web-2" in shown.stdout
    assert "  attempt 2: host=web-3" in shown.stdout
    assert "  attempts:  2: 1 of 2 counted, 1 lost with their host not counted (at most 4)" in shown.stdout
    assert "  failure:   retry on exit:75, lost; fail on signal:KILL; at most 4 lost attempts" in shown.stdout
    data = json.loads(cli("show", str(run_id), "--json", dsn=dsn).stdout)
    assert data["failure_rules"] == {"retry_on": ["exit:75", "lost"], "fail_on": ["signal:KILL"],
                                     "count_lost": False, "max_lost_attempts": 4, "uncounted_attempts": [1]}

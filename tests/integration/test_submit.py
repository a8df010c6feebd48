"""unitvisor.submit_run (the SQL function) and store.submit_run against the real schema."""

from __future__ import annotations

import re
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.types.json import Jsonb

from supervisor import store
from tests.integration.conftest import assert_nothing_written, table_counts, table_exists

HOSTILE = "'; DROP TABLE unitvisor.runs; --"

# The SQL type of each submit_run argument, so that every value reaches the function with its
# declared type (and a bigint overflow is a bigint overflow, not a failed function lookup).
ARG_TYPES = {
    "argv": "text[]", "environment": "jsonb", "working_directory": "text", "run_user": "text",
    "memory_max": "bigint", "cpu_quota_percent": "integer", "tasks_max": "integer", "io_weight": "integer",
    "runtime_max_sec": "bigint", "max_attempts": "integer", "host_pin": "text", "priority": "integer",
    "retry_backoff_sec": "integer", "retry_backoff_max_sec": "integer", "retry_on": "text[]",
    "private_network": "boolean", "idempotency_key": "text", "labels": "jsonb",
    "concurrency_key": "text", "not_before": "timestamptz", "start_deadline": "timestamptz",
    "memory_high": "bigint",
    "stop_signal": "text", "stop_timeout": "integer", "warn_before": "integer", "warn_signal": "text",  # schema 026
    "fail_on": "text[]", "count_lost": "boolean", "max_lost_attempts": "integer",  # schema 27
    "concurrency_limit": "integer",  # schema 32
}


def call_submit(conn: psycopg.Connection, **values: Any) -> uuid.UUID:
    """SELECT unitvisor.submit_run(name => value::type, ...), as a control plane would call it."""
    values.setdefault("argv", ["/bin/true"])
    args = sql.SQL(", ").join(
        sql.SQL("{} => %s::{}").format(sql.Identifier(name), sql.SQL(ARG_TYPES[name])) for name in values)
    params = [Jsonb(v) if name in ("environment", "labels") else v for name, v in values.items()]
    return conn.execute(sql.SQL("SELECT unitvisor.submit_run({})").format(args), params).fetchone()[0]


def test_submit_run_creates_run_job_and_event(conn: psycopg.Connection) -> None:
    run_id = call_submit(conn, argv=["/bin/sh", "-c", "echo hi"], environment={"A": "1"},
                         working_directory="/tmp", run_user="nobody", memory_max=256 << 20,
                         cpu_quota_percent=50, tasks_max=32, io_weight=100, runtime_max_sec=60,
                         max_attempts=3, host_pin="host-a", priority=7, retry_on=["exit-code"])
    assert isinstance(run_id, uuid.UUID)
    run = store.get_run(conn, run_id)
    assert run is not None
    assert run.state == "queued"
    assert run.argv == ["/bin/sh", "-c", "echo hi"]
    assert run.environment == {"A": "1"}
    assert (run.working_directory, run.run_user, run.host_pin) == ("/tmp", "nobody", "host-a")
    assert (run.memory_max, run.cpu_quota_percent, run.tasks_max, run.io_weight, run.runtime_max_sec) == (
        256 << 20, 50, 32, 100, 60)
    assert (run.max_attempts, run.priority, run.retry_on) == (3, 7, ["exit-code"])
    assert run.finished_at is None and run.cancel_requested_at is None

    jobs = conn.execute(
        "SELECT state, priority, claimed_by, claimed_at, scheduled_at <= now() FROM unitvisor.spawn_jobs "
        "WHERE run_id = %s", (run_id,)).fetchall()
    assert jobs == [("available", 7, None, None, True)]
    events = conn.execute("SELECT state, reason, attempt, host_id FROM unitvisor.run_events WHERE run_id = %s",
                          (run_id,)).fetchall()
    assert events == [("queued", "submitted", None, None)]
    assert table_counts(conn) == {"runs": 1, "spawn_jobs": 1, "run_events": 1, "attempts": 0, "hosts": 0}


def test_submit_run_defaults(conn: psycopg.Connection) -> None:
    run_id = conn.execute("SELECT unitvisor.submit_run(ARRAY['/usr/bin/env', 'echo', 'hi'])").fetchone()[0]
    run = store.get_run(conn, run_id)
    assert run.environment == {}
    assert (run.max_attempts, run.priority, run.retry_backoff_sec, run.retry_backoff_max_sec) == (1, 0, 10, 600)
    assert run.memory_max is None and run.host_pin is None and run.retry_on is None
    # A NULL environment is the empty one, not a constraint failure.
    other = conn.execute("SELECT unitvisor.submit_run(ARRAY['/bin/true'], environment => NULL)").fetchone()[0]
    assert store.get_run(conn, other).environment == {}


def test_each_submit_gets_its_own_run_and_job(conn: psycopg.Connection) -> None:
    ids = {call_submit(conn) for _ in range(5)}
    assert len(ids) == 5
    assert table_counts(conn)["spawn_jobs"] == 5
    per_run = conn.execute("SELECT run_id, count(*) FROM unitvisor.spawn_jobs WHERE state = 'available' "
                           "GROUP BY run_id").fetchall()
    assert {r for r, _ in per_run} == ids and {n for _, n in per_run} == {1}


def test_submit_in_a_rolled_back_transaction_leaves_nothing(conn: psycopg.Connection) -> None:
    with conn.transaction():
        run_id = call_submit(conn)
        # Inside the transaction the three rows are there...
        assert table_counts(conn)["runs"] == 1 and table_counts(conn)["spawn_jobs"] == 1
        raise psycopg.Rollback()
    # ...and after the rollback none of them.
    assert store.get_run(conn, run_id) is None
    assert_nothing_written(conn)


def test_submit_rolls_back_with_the_callers_failing_transaction(conn: psycopg.Connection) -> None:
    with pytest.raises(psycopg.errors.DivisionByZero):
        with conn.transaction():
            store.submit_run(conn, argv=["/bin/true"])
            conn.execute("SELECT 1 / 0")
    assert_nothing_written(conn)


REJECTED = [
    pytest.param({"argv": []}, id="empty-argv"),
    pytest.param({"argv": ["sh", "-c", "true"]}, id="relative-argv0"),
    pytest.param({"argv": ["bin/true"]}, id="relative-argv0-with-slash"),
    pytest.param({"argv": ["/bin/echo", None]}, id="null-element"),
    pytest.param({"argv": [None, "x"]}, id="null-argv0"),
    pytest.param({"memory_max": 0}, id="memory-0"),
    pytest.param({"memory_max": -1}, id="memory-negative"),
    pytest.param({"memory_max": (1 << 20) - 1}, id="memory-below-1MiB"),
    pytest.param({"memory_max": (1 << 62) + 1}, id="memory-above-max"),
    pytest.param({"cpu_quota_percent": 0}, id="cpu-0"),
    pytest.param({"cpu_quota_percent": 100001}, id="cpu-absurd"),
    pytest.param({"tasks_max": -1}, id="tasks-negative"),
    pytest.param({"tasks_max": 0}, id="tasks-0"),
    pytest.param({"tasks_max": 4194305}, id="tasks-absurd"),
    pytest.param({"io_weight": 0}, id="io-weight-0"),
    pytest.param({"io_weight": 10001}, id="io-weight-10001"),
    pytest.param({"runtime_max_sec": 0}, id="runtime-0"),
    pytest.param({"runtime_max_sec": -5}, id="runtime-negative"),
    pytest.param({"runtime_max_sec": 315360001}, id="runtime-absurd"),
    pytest.param({"environment": {"1BAD": "x"}}, id="env-name-digit"),
    pytest.param({"environment": {"A-B": "x"}}, id="env-name-dash"),
    pytest.param({"environment": {"": "x"}}, id="env-name-empty"),
    pytest.param({"environment": {"A B": "x"}}, id="env-name-space"),
    pytest.param({"environment": {"A\n": "x"}}, id="env-name-newline"),
    pytest.param({"environment": {"A" * 129: "x"}}, id="env-name-too-long"),
    pytest.param({"environment": {"A": "x\ny"}}, id="env-value-newline"),
    pytest.param({"environment": {"A": 1}}, id="env-value-number"),
    pytest.param({"environment": {"A": None}}, id="env-value-null"),
    pytest.param({"environment": ["A=x"]}, id="env-array"),
    pytest.param({"environment": "A=x"}, id="env-string"),
    pytest.param({"environment": None}, id="env-json-null"),
    pytest.param({"working_directory": "tmp"}, id="workdir-relative"),
    pytest.param({"run_user": "Root"}, id="user-uppercase"),
    pytest.param({"run_user": ""}, id="user-empty"),
    pytest.param({"run_user": "root; rm -rf /"}, id="user-shell"),
    pytest.param({"run_user": "root\n"}, id="user-newline"),
    pytest.param({"run_user": "a" * 33}, id="user-too-long"),
    pytest.param({"max_attempts": 0}, id="max-attempts-0"),
    pytest.param({"max_attempts": 1001}, id="max-attempts-absurd"),
    pytest.param({"retry_backoff_sec": -1}, id="backoff-negative"),
    pytest.param({"retry_backoff_sec": 100, "retry_backoff_max_sec": 50}, id="backoff-max-below-base"),
    pytest.param({"retry_on": ["success"]}, id="retry-on-success"),
    pytest.param({"retry_on": ["exit-code", "success"]}, id="retry-on-with-success"),
    pytest.param({"retry_on": ["cancelled"]}, id="retry-on-cancelled"),
]


@pytest.mark.parametrize("values", REJECTED)
def test_constraints_reject_bad_runs_and_nothing_is_written(conn: psycopg.Connection, values: dict) -> None:
    # environment=None means JSON null here: pass it as a jsonb 'null', not as SQL NULL.
    if "environment" in values and values["environment"] is None:
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute("SELECT unitvisor.submit_run(ARRAY['/bin/true'], environment => 'null'::jsonb)")
    else:
        with pytest.raises(psycopg.errors.CheckViolation) as info:
            call_submit(conn, **values)
        assert info.value.diag.constraint_name.startswith("runs_")
    assert_nothing_written(conn)
    # The connection is still usable, and a good run still goes in.
    call_submit(conn)
    assert table_counts(conn)["runs"] == 1


def test_a_null_argv_is_rejected(conn: psycopg.Connection) -> None:
    with pytest.raises(psycopg.errors.NotNullViolation):
        conn.execute("SELECT unitvisor.submit_run(NULL::text[])")
    assert_nothing_written(conn)


def test_a_bigint_overflow_is_an_error_and_nothing_is_written(conn: psycopg.Connection) -> None:
    with pytest.raises(psycopg.errors.NumericValueOutOfRange):
        call_submit(conn, memory_max=10**19)
    assert_nothing_written(conn)
    with pytest.raises(psycopg.errors.NumericValueOutOfRange):
        call_submit(conn, tasks_max=2**31)
    assert_nothing_written(conn)


def test_store_submit_of_a_bigint_overflow_is_an_error_and_nothing_is_written(conn: psycopg.Connection) -> None:
    with pytest.raises((psycopg.Error, store.DatabaseError)):
        store.submit_run(conn, argv=["/bin/true"], memory_max=10**19)
    assert_nothing_written(conn)


@pytest.mark.parametrize("values", [{"memory_max": 10**19}, {"priority": 2**31}], ids=["memory", "priority"])
def test_store_submit_reports_an_out_of_range_number_as_a_database_error(conn: psycopg.Connection,
                                                                          values: dict) -> None:
    try:
        with pytest.raises(store.DatabaseError):
            store.submit_run(conn, argv=["/bin/true"], **values)
    finally:
        assert_nothing_written(conn)


@pytest.mark.parametrize(("values", "constraint"), [
    ({"argv": []}, "runs_argv_valid"),
    ({"argv": ["sh"]}, "runs_argv_valid"),
    ({"argv": ["/bin/true"], "memory_max": 0}, "runs_memory_max_valid"),
    ({"argv": ["/bin/true"], "io_weight": 10001}, "runs_io_weight_valid"),
    ({"argv": ["/bin/true"], "environment": {"A": "x\ny"}}, "runs_environment_valid"),
    ({"argv": ["/bin/true"], "environment": ["not", "an", "object"]}, "runs_environment_valid"),
    ({"argv": ["/bin/true"], "run_user": "Bad User"}, "runs_run_user_valid"),
    ({"argv": ["/bin/true"], "max_attempts": 0}, "runs_max_attempts_valid"),
])
def test_store_submit_wraps_check_violations(conn: psycopg.Connection, values: dict, constraint: str) -> None:
    with pytest.raises(store.DatabaseError, match=constraint) as info:
        store.submit_run(conn, **values)
    assert not isinstance(info.value, psycopg.Error)
    assert "\n" not in str(info.value)
    assert_nothing_written(conn)


def test_store_submit_refuses_unknown_fields(conn: psycopg.Connection) -> None:
    with pytest.raises(TypeError, match="state"):
        store.submit_run(conn, argv=["/bin/true"], state="running")
    assert_nothing_written(conn)


def test_store_submit_passes_every_field(conn: psycopg.Connection) -> None:
    run_id = store.submit_run(conn, argv=["/bin/echo", "x"], environment={"B": "2"}, working_directory="/srv",
                              run_user="daemon", memory_max=1 << 30, cpu_quota_percent=200, tasks_max=8,
                              io_weight=500, runtime_max_sec=90, max_attempts=4, host_pin="h9", priority=-3)
    run = store.get_run(conn, run_id)
    assert (run.argv, run.environment, run.working_directory, run.run_user) == (
        ["/bin/echo", "x"], {"B": "2"}, "/srv", "daemon")
    assert (run.memory_max, run.cpu_quota_percent, run.tasks_max, run.io_weight, run.runtime_max_sec) == (
        1 << 30, 200, 8, 500, 90)
    assert (run.max_attempts, run.host_pin, run.priority) == (4, "h9", -3)
    job_priority = conn.execute("SELECT priority FROM unitvisor.spawn_jobs WHERE run_id = %s", (run_id,)).fetchone()
    assert job_priority == (-3,)


def test_sql_looking_strings_are_stored_verbatim(conn: psycopg.Connection) -> None:
    argv = ["/bin/echo", HOSTILE, "$(rm -rf /)", 'Robert"); DROP TABLE unitvisor.spawn_jobs;--', "%s %(x)s {}",
            "\\x00'\"`", "ünïcødé ✓"]
    environment = {"X": HOSTILE, "Y": "%s", "Z": "'); DELETE FROM unitvisor.runs; --"}
    workdir = "/tmp/" + HOSTILE
    run_id = store.submit_run(conn, argv=argv, environment=environment, working_directory=workdir,
                              host_pin=HOSTILE)
    # And through the SQL function directly, too.
    other = call_submit(conn, argv=["/bin/echo", HOSTILE], environment={"X": HOSTILE}, working_directory=workdir)

    for table in ("unitvisor.runs", "unitvisor.spawn_jobs", "unitvisor.run_events", "unitvisor.attempts"):
        assert table_exists(conn, table), table
    run = store.get_run(conn, run_id)
    assert run.argv == argv
    assert run.environment == environment
    assert run.working_directory == workdir
    assert run.host_pin == HOSTILE
    assert store.get_run(conn, other).argv == ["/bin/echo", HOSTILE]
    assert table_counts(conn)["runs"] == 2


def test_an_array_with_another_lower_bound_cannot_smuggle_a_relative_argv0(conn: psycopg.Connection) -> None:
    try:
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute("SELECT unitvisor.submit_run('[2:3]={sh,-c}'::text[])")
    finally:
        assert_nothing_written(conn)


# -- refusals a caller can act on (sql/005_sql_api.sql) ------------------------------------------------

SECRET = "s3cr3t-Value-never-logged"
# Every environment a refusal case sends holds SECRET as a value (and, where the name is refused, in
# the name too): no message, detail, hint or context may ever show it.
REFUSALS = [
    # (arguments, constraint, the message's start)
    pytest.param({"argv": []}, "runs_argv_valid", "argv: must be a one-dimensional array", id="argv-empty"),
    pytest.param({"argv": ["/bin/echo", None]}, "runs_argv_valid", "argv: element 2 is NULL", id="argv-null"),
    pytest.param({"argv": ["sh", "-c"]}, "runs_argv_valid", "argv: the first element must be an absolute path",
                 id="argv-relative"),
    pytest.param({"environment": ["A=x"]}, "runs_environment_valid",
                 "environment: must be a JSON object of NAME -> string, not a JSON array", id="env-array"),
    pytest.param({"environment": {f"PASSWORD={SECRET}": "x", "OK": SECRET}}, "runs_environment_valid",
                 "environment: 1 name(s) are not valid variable names", id="env-name"),
    pytest.param({"environment": {"OK": SECRET, "N": 1}}, "runs_environment_valid",
                 "environment: the value of N is not a string", id="env-value-type"),
    pytest.param({"environment": {"OK": SECRET + "\nmore"}}, "runs_environment_valid",
                 "environment: the value of OK contains a newline", id="env-value-newline"),
    pytest.param({"working_directory": "tmp"}, "runs_working_directory_valid",
                 "working_directory: must be an absolute path", id="workdir"),
    pytest.param({"run_user": "Root"}, "runs_run_user_valid", "run_user: is not a user name", id="run-user"),
    pytest.param({"memory_max": 1024}, "runs_memory_max_valid",
                 "memory_max: 1024 is out of range (1048576 to 4611686018427387904 bytes)", id="memory-max"),
    pytest.param({"memory_high": 1024}, "runs_memory_high_valid",
                 "memory_high: 1024 is out of range (1048576 to 4611686018427387904 bytes)", id="memory-high"),
    pytest.param({"memory_high": (1 << 62) + 1}, "runs_memory_high_valid",
                 "memory_high: 4611686018427387905 is out of range (1048576 to", id="memory-high-above-max"),
    pytest.param({"memory_high": 512 << 20, "memory_max": 256 << 20}, "runs_memory_high_valid",
                 "memory_high: 536870912 is above memory_max (268435456): a run is throttled at memory_high "
                 "before it is killed at memory_max", id="memory-high-over-memory-max"),
    pytest.param({"cpu_quota_percent": 0}, "runs_cpu_quota_valid",
                 "cpu_quota_percent: 0 is out of range (1 to 100000", id="cpu-quota"),
    pytest.param({"tasks_max": 0}, "runs_tasks_max_valid", "tasks_max: 0 is out of range (1 to 4194304 tasks)",
                 id="tasks-max"),
    pytest.param({"io_weight": 10001}, "runs_io_weight_valid", "io_weight: 10001 is out of range (1 to 10000)",
                 id="io-weight"),
    pytest.param({"runtime_max_sec": 0}, "runs_runtime_max_valid",
                 "runtime_max_sec: 0 is out of range (1 to 315360000 seconds)", id="runtime-max"),
    pytest.param({"max_attempts": 1001}, "runs_max_attempts_valid", "max_attempts: 1001 is out of range (1 to 1000)",
                 id="max-attempts"),
    pytest.param({"retry_backoff_sec": -1}, "runs_backoff_valid",
                 "retry_backoff_sec: -1 is out of range (0 to 86400 seconds)", id="backoff"),
    pytest.param({"retry_backoff_sec": 100, "retry_backoff_max_sec": 50}, "runs_backoff_valid",
                 "retry_backoff_max_sec: 50 is out of range (retry_backoff_sec, here 100, to 604800 seconds)",
                 id="backoff-max"),
    pytest.param({"retry_on": ["success"]}, "runs_retry_on_valid", "retry_on: success: may hold only exit-code",
                 id="retry-on"),
    # schema 27: failure rules
    pytest.param({"retry_on": ["signal:FOO"]}, "runs_retry_on_valid", "retry_on: signal:FOO names no signal",
                 id="retry-on-signal"),
    pytest.param({"retry_on": ["exit:256"]}, "runs_retry_on_valid", "retry_on: exit:256 is no exit status",
                 id="retry-on-exit"),
    pytest.param({"fail_on": ["exit:256"]}, "runs_fail_on_valid", "fail_on: exit:256 is no exit status",
                 id="fail-on"),
    pytest.param({"fail_on": ["exit:3"], "retry_on": ["exit:3"]}, "runs_fail_on_valid",
                 "fail_on: exit:3 is in retry_on too", id="fail-on-and-retry-on"),
    pytest.param({"max_lost_attempts": 0}, "runs_max_lost_attempts_valid",
                 "max_lost_attempts: 0 is out of range (1 to 1000)", id="max-lost-attempts"),
    pytest.param({"concurrency_key": "k", "concurrency_limit": 0}, "runs_concurrency_limit_valid",
                 "concurrency_limit: 0 is out of range (1 to 10000)", id="concurrency-limit"),
    pytest.param({"concurrency_limit": 2}, "runs_concurrency_limit_valid",
                 "concurrency_limit: needs concurrency_key", id="concurrency-limit-without-key"),
    pytest.param({"labels": {"team": 1}}, "runs_labels_valid", "labels: must be a JSON object", id="labels-number"),
    pytest.param({"labels": {"-bad": "x"}}, "runs_labels_valid", "labels: must be a JSON object", id="labels-key"),
    pytest.param({"labels": {"k": "x" * 256}}, "runs_labels_valid", "labels: must be a JSON object",
                 id="labels-long-value"),
    pytest.param({"labels": {f"k{i}": "v" for i in range(65)}}, "runs_labels_valid", "labels: must be a JSON object",
                 id="labels-too-many"),
    pytest.param({"labels": ["a"]}, "runs_labels_valid", "labels: must be a JSON object", id="labels-array"),
    pytest.param({"idempotency_key": ""}, "runs_idempotency_key_valid", "idempotency_key: must be 1 to 255",
                 id="key-empty"),
    pytest.param({"idempotency_key": "a\nb"}, "runs_idempotency_key_valid", "idempotency_key: must be 1 to 255",
                 id="key-newline"),
    pytest.param({"concurrency_key": ""}, "runs_concurrency_key_valid", "concurrency_key: must be 1 to 255",
                 id="concurrency-key-empty"),
    pytest.param({"concurrency_key": "a\tb"}, "runs_concurrency_key_valid", "concurrency_key: must be 1 to 255",
                 id="concurrency-key-control"),
    pytest.param({"concurrency_key": "k" * 256}, "runs_concurrency_key_valid", "concurrency_key: must be 1 to 255",
                 id="concurrency-key-long"),
    pytest.param({"not_before": "infinity"}, "runs_not_before_valid", "not_before: must be a finite time",
                 id="not-before-infinity"),
    pytest.param({"start_deadline": "infinity"}, "runs_start_deadline_valid", "start_deadline: must be a finite time",
                 id="deadline-infinity"),
    pytest.param({"not_before": "2100-01-01 12:00Z", "start_deadline": "2100-01-01 11:59Z"},
                 "runs_start_deadline_valid", "start_deadline: must be later than not_before", id="deadline-early"),
    pytest.param({"not_before": "2100-01-01 12:00Z", "start_deadline": "2100-01-01 12:00Z"},
                 "runs_start_deadline_valid", "start_deadline: must be later than not_before", id="deadline-same"),
    pytest.param({"start_deadline": "2000-01-01 00:00Z"}, "runs_start_deadline_valid",
                 "start_deadline: must be in the future", id="deadline-past"),
    # Graceful stop (schema 026): signals by name from a fixed list, seconds in range, a warning only
    # before a runtime limit.
    pytest.param({"stop_signal": "SEGV"}, "runs_stop_signal_valid",
                 "stop_signal: must be one of TERM, INT, HUP, QUIT, USR1, USR2, ALRM, WINCH, KILL", id="stop-signal"),
    pytest.param({"stop_signal": "15"}, "runs_stop_signal_valid", "stop_signal: must be one of",
                 id="stop-signal-number"),
    pytest.param({"stop_signal": "TERM; rm -rf /"}, "runs_stop_signal_valid", "stop_signal: must be one of",
                 id="stop-signal-hostile"),
    pytest.param({"stop_timeout": 0}, "runs_stop_timeout_valid", "stop_timeout: 0 is out of range (1 to 3600 seconds)",
                 id="stop-timeout"),
    pytest.param({"warn_before": 10}, "runs_warn_before_valid", "warn_before: needs runtime_max_sec",
                 id="warn-before-alone"),
    pytest.param({"warn_before": 0, "runtime_max_sec": 60}, "runs_warn_before_valid",
                 "warn_before: 0 is out of range (at least 1 second, and less than runtime_max_sec)",
                 id="warn-before-zero"),
    pytest.param({"warn_before": 60, "runtime_max_sec": 60}, "runs_warn_before_valid",
                 "warn_before: 60 is not less than runtime_max_sec (60)", id="warn-before-not-before"),
    pytest.param({"warn_before": 10, "runtime_max_sec": 60, "warn_signal": "KILL"}, "runs_warn_signal_valid",
                 "warn_signal: must be one of TERM, INT, HUP, QUIT, USR1, USR2, ALRM, WINCH (", id="warn-signal-kill"),
    pytest.param({"warn_signal": "USR1"}, "runs_warn_signal_valid", "warn_signal: needs warn_before",
                 id="warn-signal-alone"),
]


def assert_no_secret(exc: psycopg.Error) -> None:
    diag = exc.diag
    for part in (str(exc), diag.message_primary, diag.message_detail, diag.message_hint, diag.context):
        assert SECRET not in (part or "")
    # The row is never dumped: the DETAIL PostgreSQL gives a failed CHECK ("Failing row contains").
    assert diag.message_detail is None


def test_every_constraint_of_runs_that_an_argument_can_break_has_a_refusal_case(conn: psycopg.Connection) -> None:
    constraints = {row[0] for row in conn.execute(
        "SELECT conname FROM pg_constraint WHERE conrelid = 'unitvisor.runs'::regclass AND contype = 'c'")}
    # runs_state_valid: state is no argument of submit_run, which always inserts 'queued'. Every check of
    # an argument is one of unitvisor.run_argument_problem's (schema 22), which submit_run and the trigger
    # runs_arguments_valid both call, and each name it reports has a case. But runs_river_job_id_valid
    # (schema 34): river_job_id is the River source's link, set by the daemons (submit_river_run), not a
    # control plane's argument; submit_run refuses it by name, and the column's CHECK is the backstop
    # (docs/examples/river.sql, checked by test_river.py, shows its refusal).
    assert constraints == {"runs_state_valid", "runs_river_job_id_valid"}
    body = conn.execute("SELECT prosrc FROM pg_proc WHERE proname = 'run_argument_problem'").fetchone()[0]
    reported = set(re.findall(r"'(runs_\w+_valid)'", body))
    assert reported and reported == {case.values[1] for case in REFUSALS}


@pytest.mark.parametrize(("values", "constraint", "message"), REFUSALS)
def test_a_refused_argument_gets_one_clear_message_without_the_row(conn: psycopg.Connection, values: dict,
                                                                  constraint: str, message: str) -> None:
    values = {"environment": {"TOKEN": SECRET}, **values}
    with pytest.raises(psycopg.errors.CheckViolation) as info:
        call_submit(conn, **values)
    assert info.value.diag.message_primary.startswith(message)
    assert info.value.diag.constraint_name == constraint
    assert_no_secret(info.value)
    assert_nothing_written(conn)


@pytest.mark.parametrize("argument", ["max_attempts", "priority", "retry_backoff_sec", "retry_backoff_max_sec",
                                      "concurrency_limit"])
def test_an_explicit_null_for_a_not_null_column_names_the_argument(conn: psycopg.Connection, argument: str) -> None:
    with pytest.raises(psycopg.errors.NotNullViolation) as info:
        call_submit(conn, environment={"TOKEN": SECRET}, **{argument: None})
    assert info.value.diag.message_primary.startswith(f"{argument}: must not be NULL")
    assert_no_secret(info.value)
    assert_nothing_written(conn)


def test_a_null_argv_names_the_argument(conn: psycopg.Connection) -> None:
    with pytest.raises(psycopg.errors.NotNullViolation, match="argv: must not be NULL"):
        conn.execute("SELECT unitvisor.submit_run(NULL::text[])")


def test_a_constraint_submit_run_does_not_foresee_does_not_leak_the_row(conn: psycopg.Connection) -> None:
    # A constraint added later (by a migration, or a control plane's own): the function knows nothing
    # of it, and the row must still not reach the caller's logs.
    conn.execute("ALTER TABLE unitvisor.runs ADD CONSTRAINT runs_pin_not_forbidden CHECK (host_pin <> 'forbidden')")
    with pytest.raises(psycopg.errors.CheckViolation) as info:
        call_submit(conn, environment={"TOKEN": SECRET}, host_pin="forbidden")
    assert info.value.diag.constraint_name == "runs_pin_not_forbidden"
    assert info.value.diag.message_primary == "the run was refused by constraint runs_pin_not_forbidden"
    assert_no_secret(info.value)
    assert_nothing_written(conn)


def test_store_submit_passes_the_refusal_on(conn: psycopg.Connection) -> None:
    with pytest.raises(store.DatabaseError) as info:
        store.submit_run(conn, argv=["/bin/true"], memory_max=1024, environment={"TOKEN": SECRET})
    assert str(info.value) == ("the database refused the run: memory_max: 1024 is out of range "
                               "(1048576 to 4611686018427387904 bytes) (runs_memory_max_valid)")


# -- labels and idempotency keys (sql/005_sql_api.sql) -------------------------------------------------


def test_labels_are_stored_and_default_to_none(conn: psycopg.Connection) -> None:
    labelled = call_submit(conn, labels={"team": "infra", "app.kubernetes.io/name": "x-1"})
    assert store.get_run(conn, labelled).labels == {"team": "infra", "app.kubernetes.io/name": "x-1"}
    assert store.get_run(conn, call_submit(conn)).labels == {}
    # SQL NULL is no labels (a JSON null is refused, as for environment).
    other = conn.execute("SELECT unitvisor.submit_run(ARRAY['/bin/true'], labels => NULL)").fetchone()[0]
    assert store.get_run(conn, other).labels == {}


def test_a_retried_submit_with_the_same_key_returns_the_same_run_and_writes_nothing(conn: psycopg.Connection) -> None:
    first = call_submit(conn, idempotency_key="order-42")
    before = table_counts(conn)
    assert call_submit(conn, idempotency_key="order-42") == first
    # Other arguments under the same key: the key names the request, and the first one wins.
    assert call_submit(conn, argv=["/bin/false"], idempotency_key="order-42") == first
    assert table_counts(conn) == before
    assert store.get_run(conn, first).argv == ["/bin/true"]
    assert call_submit(conn, idempotency_key="order-43") != first
    assert call_submit(conn) != call_submit(conn)  # no key: a new run each time


def test_a_key_is_valid_input_even_when_it_looks_like_sql(conn: psycopg.Connection) -> None:
    first = call_submit(conn, idempotency_key=HOSTILE)
    assert call_submit(conn, idempotency_key=HOSTILE) == first


def blocked(conn: psycopg.Connection, waiter: psycopg.Connection, worker: threading.Thread) -> None:
    """Until `waiter`'s session waits on a lock (the other's uncommitted key), never by a sleep that a
    loaded machine could outrun: a test must know the second submit really met the first one's row."""
    pid = waiter.info.backend_pid
    deadline = time.monotonic() + 30
    while not conn.execute("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s",
                           (pid,)).fetchone()[0]:
        assert worker.is_alive(), "the second submit ended without waiting for the first"
        assert time.monotonic() < deadline, "the second submit never waited for the first"
        time.sleep(0.01)


def test_concurrent_submits_with_one_key_make_one_run(conn: psycopg.Connection, dsn: str) -> None:
    with store.connect(dsn) as a, store.connect(dsn) as b:
        with a.transaction():
            first = call_submit(a, idempotency_key="race")
            # b's submit waits on a's uncommitted row (the unique index), then returns a's run.
            result: list[uuid.UUID] = []
            worker = threading.Thread(target=lambda: result.append(call_submit(b, idempotency_key="race")))
            worker.start()
            blocked(conn, b, worker)
        worker.join(10)
        assert result == [first]
    assert table_counts(conn)["runs"] == 1 and table_counts(conn)["spawn_jobs"] == 1


def test_a_key_whose_first_submit_rolled_back_is_free_again(conn: psycopg.Connection, dsn: str) -> None:
    with store.connect(dsn) as a, store.connect(dsn) as b:
        result: list[uuid.UUID] = []
        worker = threading.Thread(target=lambda: result.append(call_submit(b, idempotency_key="retry-me")))
        with a.transaction():
            call_submit(a, idempotency_key="retry-me")
            worker.start()
            blocked(conn, b, worker)
            raise psycopg.Rollback()  # what a failed first submit leaves: nothing
        worker.join(10)
    assert len(result) == 1 and store.get_run(conn, result[0]) is not None
    assert table_counts(conn)["runs"] == 1


def test_calls_written_for_earlier_versions_still_work(conn: psycopg.Connection) -> None:
    # Version 1's fifteen arguments, positional, as a control plane may have written them.
    positional = conn.execute(
        "SELECT unitvisor.submit_run(ARRAY['/bin/true'], '{}'::jsonb, NULL, NULL, 1048576, NULL, NULL, NULL, "
        "NULL, 2, NULL, 3, 10, 600, NULL)").fetchone()[0]
    assert (store.get_run(conn, positional).max_attempts, store.get_run(conn, positional).priority) == (2, 3)
    # 0.2.0's CLI: named arguments, each cast (store.submit_run of that release).
    named = conn.execute("SELECT unitvisor.submit_run(argv => %s::text[], memory_max => %s::bigint, "
                         "priority => %s::integer, private_network => %s::boolean)",
                         (["/bin/true"], 1 << 30, 1, True)).fetchone()[0]
    run = store.get_run(conn, named)
    assert (run.memory_max, run.priority, run.private_network, run.labels) == (1 << 30, 1, True, {})


def test_submit_run_is_a_security_definer_with_the_grants_of_004(conn: psycopg.Connection) -> None:
    rows = conn.execute(
        """SELECT p.prosecdef, p.proconfig, pg_get_userbyid(p.proowner),
                  has_function_privilege('unitvisor_submitter', p.oid, 'EXECUTE'),
                  has_function_privilege('unitvisor_host', p.oid, 'EXECUTE')
           FROM pg_proc p WHERE p.oid = 'unitvisor.submit_run'::regproc""").fetchall()
    assert rows == [(True, ["search_path=pg_catalog, pg_temp"], store.ADMIN_ROLE, True, False)]


def test_under_repeatable_read_a_concurrent_submit_with_one_key_is_a_serialization_failure(
        conn: psycopg.Connection, dsn: str) -> None:
    # What docs/sql-api.md tells a caller to expect, and to retry: the retry returns the run.
    with store.connect(dsn) as a, store.connect(dsn) as b:
        b.execute("SET default_transaction_isolation = 'repeatable read'")
        errors: list[BaseException] = []

        def second() -> None:
            try:
                with b.transaction():
                    call_submit(b, idempotency_key="rr")
            except psycopg.Error as exc:
                errors.append(exc)

        worker = threading.Thread(target=second)
        with a.transaction():
            first = call_submit(a, idempotency_key="rr")
            worker.start()
            blocked(conn, b, worker)
        worker.join(10)
        assert [type(e) for e in errors] == [psycopg.errors.SerializationFailure]
        with b.transaction():
            assert call_submit(b, idempotency_key="rr") == first
    assert table_counts(conn)["runs"] == 1


@pytest.mark.parametrize(("values", "expected"), [
    ({"memory_high": 384 << 20}, (None, 384 << 20)),
    ({"memory_high": 256 << 20, "memory_max": 256 << 20}, (256 << 20, 256 << 20)),  # at the limit: allowed
    ({}, (None, None)),
])
def test_memory_high_is_kept_on_the_run(conn: psycopg.Connection, values: dict, expected: tuple) -> None:
    run = store.get_run(conn, call_submit(conn, **values))
    assert (run.memory_max, run.memory_high) == expected
    assert store.get_run(conn, store.submit_run(conn, argv=["/bin/true"], **values)).memory_high == expected[1]


def test_a_row_over_its_memory_max_is_refused_by_the_table_too(conn: psycopg.Connection) -> None:
    """The constraint behind submit_run's check, for a row written another way (an admin's UPDATE)."""
    run_id = call_submit(conn, memory_max=256 << 20)
    with pytest.raises(psycopg.errors.CheckViolation) as info:
        conn.execute("UPDATE unitvisor.runs SET memory_high = %s WHERE id = %s", (512 << 20, run_id))
    assert info.value.diag.constraint_name == "runs_memory_high_valid"

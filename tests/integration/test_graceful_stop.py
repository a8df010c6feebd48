"""Graceful stop (schema 026): submit_run's stop_signal, stop_timeout, warn_before and warn_signal, the
trigger that checks a row written another way, and mark_warned (a warning recorded once per attempt,
whichever session or daemon tries)."""

from __future__ import annotations

import threading
import uuid

import psycopg
import pytest

from supervisor import stopsignals, store, unitspec
from supervisor.model import Attempt
from tests.integration.conftest import fence_of, register, run_concurrently
from tests.integration.test_submit import call_submit

pytestmark = pytest.mark.usefixtures("as_bound_roles")


def claimed(conn: psycopg.Connection, host: str = "h1", **values: object) -> tuple[uuid.UUID, Attempt]:
    run_id = store.submit_run(conn, argv=["/bin/true"], **values)
    [(_, attempt)] = store.claim(conn, register(conn, host), 1, unitspec.UNIT_NAME_FORMAT)
    assert attempt.run_id == run_id
    return run_id, attempt


def test_a_run_keeps_its_stop_settings_with_signal_names_made_short(conn: psycopg.Connection) -> None:
    run_id = call_submit(conn, stop_signal="sigint", stop_timeout=5, runtime_max_sec=60, warn_before=10,
                         warn_signal="SIGUSR2")
    run = store.get_run(conn, run_id)
    assert (run.stop_signal, run.stop_timeout, run.warn_before, run.warn_signal) == ("INT", 5, 10, "USR2")


def test_without_them_a_run_is_as_before_and_a_warning_alone_is_usr1(conn: psycopg.Connection) -> None:
    plain = store.get_run(conn, call_submit(conn))
    assert (plain.stop_signal, plain.stop_timeout, plain.warn_before, plain.warn_signal) == (None, None, None, None)
    warned = store.get_run(conn, call_submit(conn, runtime_max_sec=60, warn_before=10))
    assert (warned.warn_before, warned.warn_signal) == (10, "USR1")


def test_sql_and_python_allow_the_same_signals(conn: psycopg.Connection) -> None:
    assert tuple(conn.execute("SELECT unitvisor.stop_signal_names()").fetchone()[0]) == stopsignals.SIGNALS


def test_store_submit_names_the_refused_argument(conn: psycopg.Connection) -> None:
    with pytest.raises(store.DatabaseError, match=r"stop_signal: must be one of .* \(runs_stop_signal_valid\)"):
        store.submit_run(conn, argv=["/bin/true"], stop_signal="STOP")
    with pytest.raises(store.DatabaseError, match=r"warn_before: needs runtime_max_sec .*\(runs_warn_before_valid\)"):
        store.submit_run(conn, argv=["/bin/true"], warn_before=5)


def test_a_row_written_another_way_is_checked_as_submit_run_checks_it(conn: psycopg.Connection) -> None:
    run_id = call_submit(conn, runtime_max_sec=60, warn_before=10)
    with pytest.raises(psycopg.errors.CheckViolation) as info:
        conn.execute("UPDATE unitvisor.runs SET stop_signal = 'SEGV' WHERE id = %s", (run_id,))
    assert info.value.diag.constraint_name == "runs_stop_signal_valid"
    with pytest.raises(psycopg.errors.CheckViolation) as info:
        conn.execute("UPDATE unitvisor.runs SET runtime_max_sec = 10 WHERE id = %s", (run_id,))
    assert info.value.diag.constraint_name == "runs_warn_before_valid"


def test_a_warning_is_marked_once_with_its_event(conn: psycopg.Connection) -> None:
    run_id, attempt = claimed(conn, runtime_max_sec=60, warn_before=10)
    fence = fence_of(conn, "h1")
    assert store.mark_warned(conn, fence, attempt, "sent SIGUSR1") is True
    assert store.mark_warned(conn, fence, attempt, "sent SIGUSR1") is False
    [stored] = store.get_attempts(conn, run_id)
    assert stored.warned_at is not None
    reasons = [e["reason"] for e in store.get_events(conn, run_id, limit=100)]
    assert reasons.count("sent SIGUSR1") == 1
    [(_, open_attempt)] = store.open_attempts(conn, "h1")
    assert open_attempt.warned_at == stored.warned_at  # what a restarted daemon reads: sent already


def test_only_the_attempts_host_marks_it_and_a_stale_epoch_is_fenced(conn: psycopg.Connection, dsn: str) -> None:
    _, attempt = claimed(conn, runtime_max_sec=60, warn_before=10)
    with store.connect(dsn) as other:
        assert store.mark_warned(other, register(other, "h2"), attempt, "not mine") is False
    stale = store.Fence("h1", fence_of(conn, "h1").epoch - 1)
    with pytest.raises(store.Fenced):
        store.mark_warned(conn, stale, attempt, "stale")


def test_concurrent_marks_of_one_warning_record_it_once(conn: psycopg.Connection, dsn: str) -> None:
    """Two sessions of the host (a daemon and its restarted self, say) mark the same warning at once:
    exactly one is the first."""
    run_id, attempt = claimed(conn, runtime_max_sec=60, warn_before=10)
    fence = fence_of(conn, "h1")
    answers: list[bool] = []
    lock = threading.Lock()

    def mark(_: str) -> None:
        with store.connect(dsn) as session:
            answer = store.mark_warned(session, fence, attempt, "sent SIGUSR1")
        with lock:
            answers.append(answer)

    run_concurrently(mark, ("a", "b", "c", "d"))
    assert sorted(answers) == [False, False, False, True]
    reasons = [e["reason"] for e in store.get_events(conn, run_id, limit=100)]
    assert reasons.count("sent SIGUSR1") == 1


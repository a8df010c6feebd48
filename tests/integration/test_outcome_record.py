"""Schema 007: an outcome keeps what systemd measured of the attempt, and the attempt the end of its
output, written once after the outcome; the 12-argument record_outcome that 0.3.0 daemons call by
position still records the outcome, with NULLs."""

from __future__ import annotations

import json
import uuid
from datetime import timedelta

import psycopg
import pytest

from supervisor import store, unitspec
from supervisor.model import Accounting, Attempt, OutcomeRecord
from supervisor.outcomes import Outcome
from tests.integration.conftest import fence_of, register

# Each test runs twice: as the superuser, and with every host call of the store made as a login role
# bound to its host id (tests/integration/conftest.py, as_bound_roles).
pytestmark = pytest.mark.usefixtures("as_bound_roles")

SUCCEEDED = Outcome("success", "exit:0", "exited 0")
MEASURED = Accounting(cpu_usage_nsec=1_234_567_890, memory_peak_bytes=35_651_584, io_read_bytes=0,
                      io_write_bytes=2**62, tasks_peak=21)


def claimed(conn: psycopg.Connection, host: str = "h1") -> tuple[uuid.UUID, Attempt]:
    run_id = store.submit_run(conn, argv=["/bin/true"], max_attempts=2)
    [(_, attempt)] = store.claim(conn, register(conn, host), 1, unitspec.UNIT_NAME_FORMAT)
    return run_id, attempt


def test_an_outcome_keeps_the_accounting_then_the_attempt_its_output_tail(conn: psycopg.Connection) -> None:
    run_id, attempt = claimed(conn)
    fence = fence_of(conn, "h1")
    tail = "line 1\nünïcode ✓\nlast line"
    assert store.record_outcome(conn, fence, attempt, SUCCEEDED, "succeeded", accounting=MEASURED)
    assert store.get_outcome_records(conn, run_id) == {1: OutcomeRecord(1, MEASURED, None)}
    assert store.record_output_tails(conn, fence, [(run_id, 1, tail)]) == 1
    assert store.get_outcome_records(conn, run_id) == {1: OutcomeRecord(1, MEASURED, tail)}
    assert store.get_run(conn, run_id).state == "succeeded"


def test_nothing_measured_is_null_and_an_empty_output_is_not(conn: psycopg.Connection) -> None:
    run_id, attempt = claimed(conn)
    fence = fence_of(conn, "h1")
    assert store.record_outcome(conn, fence, attempt, SUCCEEDED, "succeeded", accounting=Accounting(cpu_usage_nsec=5))
    assert store.record_output_tails(conn, fence, [(run_id, 1, "")]) == 1
    assert store.get_outcome_records(conn, run_id) == {1: OutcomeRecord(1, Accounting(cpu_usage_nsec=5), "")}
    row = conn.execute("SELECT memory_peak_bytes, io_read_bytes, io_write_bytes, output_tail = '' "
                       "FROM unitvisor.attempts WHERE run_id = %s", (run_id,)).fetchone()
    assert row == (None, None, None, True)  # "" (printed nothing) is not NULL (kept nothing)


def test_an_open_attempt_has_no_outcome_record_and_takes_no_tail(conn: psycopg.Connection) -> None:
    run_id, _ = claimed(conn)
    assert store.record_output_tails(conn, fence_of(conn, "h1"), [(run_id, 1, "early")]) == 0
    assert store.get_outcome_records(conn, run_id) == {}
    assert conn.execute("SELECT output_tail FROM unitvisor.attempts WHERE run_id = %s", (run_id,)).fetchone() == (None,)


def test_a_tail_is_written_once_never_replaced(conn: psycopg.Connection) -> None:
    run_id, attempt = claimed(conn)
    fence = fence_of(conn, "h1")
    assert store.record_outcome(conn, fence, attempt, SUCCEEDED, "succeeded")
    assert store.record_output_tails(conn, fence, [(run_id, 1, "first")]) == 1
    assert store.record_output_tails(conn, fence, [(run_id, 1, "second")]) == 0
    assert store.get_outcome_records(conn, run_id)[1].output_tail == "first"


def test_a_host_keeps_tails_of_its_own_attempts_only(conn: psycopg.Connection) -> None:
    mine, attempt = claimed(conn, "h1")
    theirs, other = claimed(conn, "h2")
    assert store.record_outcome(conn, fence_of(conn, "h1"), attempt, SUCCEEDED, "succeeded")
    assert store.record_outcome(conn, fence_of(conn, "h2"), other, SUCCEEDED, "succeeded")
    assert store.record_output_tails(conn, fence_of(conn, "h1"), [(mine, 1, "a"), (theirs, 1, "b"),
                                                                  (uuid.uuid4(), 1, "c")]) == 1
    assert (store.get_outcome_records(conn, mine)[1].output_tail,
            store.get_outcome_records(conn, theirs)[1].output_tail) == ("a", None)


def test_record_output_tails_is_fenced(conn: psycopg.Connection) -> None:
    run_id, attempt = claimed(conn)
    fence = fence_of(conn, "h1")
    assert store.record_outcome(conn, fence, attempt, SUCCEEDED, "succeeded")
    with pytest.raises(store.Fenced):
        store.record_output_tails(conn, store.Fence("h1", fence.epoch + 1), [(run_id, 1, "x")])


def test_record_output_tails_refuses_arrays_of_different_lengths(conn: psycopg.Connection) -> None:
    fence = register(conn, "h1")
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="must be arrays of the same length"):
        conn.execute("SELECT unitvisor.record_output_tails(%s, %s, %s::uuid[], %s::integer[], %s::text[])",
                     (fence.host_id, fence.epoch, [uuid.uuid4()], [1, 2], ["x"]))


def test_nothing_to_write_sends_no_statement(conn: psycopg.Connection) -> None:
    assert store.record_output_tails(conn, store.Fence("nobody", 1), []) == 0


def test_the_old_twelve_argument_call_by_position_still_records_the_outcome(conn: psycopg.Connection) -> None:
    """Exactly the statement a 0.3.0 daemon sends (store.record_outcome of 0.3.0), during a rolling upgrade."""
    run_id, attempt = claimed(conn)
    fence = fence_of(conn, "h1")
    with store._fencing():
        recorded = conn.execute(
            "SELECT unitvisor.record_outcome(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
            (attempt.run_id, attempt.attempt, fence.host_id, fence.epoch, "exit-code", "exit:3", "exited with status 3",
             "failed", None, "inv-1", None, None)).fetchone()[0]
    assert recorded is True
    [row] = store.get_attempts(conn, run_id)
    assert (row.outcome, row.exit_status, row.invocation_id) == ("exit-code", "exit:3", "inv-1")
    assert store.get_outcome_records(conn, run_id) == {1: OutcomeRecord(1, Accounting(), None)}
    # The old daemon proposed "failed"; since 027 the database decides (failure_verdict): attempt 1 of
    # max_attempts 2, retry_on unset, so the run is queued again.
    assert store.get_run(conn, run_id).state == "queued"
    # ... and its named form, as a control plane or a script might write it
    run2, attempt2 = claimed(conn)
    assert conn.execute(
        """SELECT unitvisor.record_outcome(run_id => %s, attempt => %s, host_id => %s, host_epoch => %s,
               outcome => 'success', exit_status => 'exit:0', reason => 'exited 0', next_state => 'succeeded',
               retry_delay => NULL, invocation_id => NULL, started_at => NULL, ended_at => NULL)""",
        (run2, attempt2.attempt, fence.host_id, fence.epoch)).fetchone()[0] is True


def test_the_old_call_is_still_fenced(conn: psycopg.Connection) -> None:
    _, attempt = claimed(conn)
    fence = fence_of(conn, "h1")
    with pytest.raises(store.Fenced), store._fencing():
        conn.execute("SELECT unitvisor.record_outcome(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
                     (attempt.run_id, attempt.attempt, fence.host_id, fence.epoch + 1, "success", "exit:0", "x",
                      "succeeded", None, None, None, None))


def test_a_second_outcome_changes_no_accounting(conn: psycopg.Connection) -> None:
    run_id, attempt = claimed(conn)
    fence = fence_of(conn, "h1")
    assert store.record_outcome(conn, fence, attempt, SUCCEEDED, "succeeded", accounting=MEASURED)
    assert not store.record_outcome(conn, fence, attempt, SUCCEEDED, "succeeded",
                                    accounting=Accounting(cpu_usage_nsec=1))
    assert store.get_outcome_records(conn, run_id) == {1: OutcomeRecord(1, MEASURED, None)}


def test_each_attempt_keeps_its_own(conn: psycopg.Connection) -> None:
    run_id, first = claimed(conn)
    fence = fence_of(conn, "h1")
    assert store.record_outcome(conn, fence, first, Outcome("exit-code", "exit:1", "exited 1"), "queued",
                                timedelta(0), accounting=MEASURED)
    conn.execute("UPDATE unitvisor.spawn_jobs SET scheduled_at = now()")
    [(_, second)] = store.claim(conn, fence, 1, unitspec.UNIT_NAME_FORMAT)
    assert store.record_outcome(conn, fence, second, SUCCEEDED, "succeeded")
    assert store.record_output_tails(conn, fence, [(run_id, 2, "second"), (run_id, 1, "first")]) == 2
    assert store.get_outcome_records(conn, run_id) == {
        1: OutcomeRecord(1, MEASURED, "first"), 2: OutcomeRecord(2, Accounting(), "second")}


@pytest.mark.parametrize("field", ["cpu_usage_nsec", "memory_peak_bytes", "io_read_bytes", "io_write_bytes",
                                   "tasks_peak"])
def test_a_negative_measurement_is_refused_naming_the_arguments(conn: psycopg.Connection, field: str) -> None:
    run_id, attempt = claimed(conn)
    with pytest.raises(psycopg.errors.CheckViolation) as info:
        store.record_outcome(conn, fence_of(conn, "h1"), attempt, SUCCEEDED, "succeeded",
                             accounting=Accounting(**{field: -1}))
    assert "must be NULL (not measured) or at least 0" in str(info.value)
    conn.rollback()
    assert store.get_attempts(conn, run_id)[0].outcome is None  # nothing recorded


def test_a_tail_over_64_kib_is_refused_without_echoing_it(conn: psycopg.Connection) -> None:
    run_id, attempt = claimed(conn)
    fence = fence_of(conn, "h1")
    assert store.record_outcome(conn, fence, attempt, SUCCEEDED, "succeeded")
    with pytest.raises(psycopg.errors.CheckViolation) as info:
        store.record_output_tails(conn, fence, [(run_id, 1, "secret" + "x" * 65531)])
    assert str(info.value).startswith("output_tails: a tail is more than the 65536 bytes an attempt keeps")
    assert "secret" not in str(info.value)
    conn.rollback()
    assert store.record_output_tails(conn, fence, [(run_id, 1, "é" * 32768)]) == 1  # 65536 bytes
    assert len(store.get_outcome_records(conn, run_id)[1].output_tail) == 32768


def test_a_host_taking_over_a_dead_hosts_attempt_records_nulls(conn: psycopg.Connection) -> None:
    run_id, attempt = claimed(conn, "h2")
    conn.execute("UPDATE unitvisor.hosts SET state = 'dead' WHERE id = 'h2'")
    # Lost, and retried as the run's policy says (max_attempts 2): the only outcome a peer may record
    # (sql/013_fleet_promises.sql).
    assert store.record_outcome(conn, register(conn, "h1"), attempt, Outcome("lost", None, "host h2 died"), "queued",
                                timedelta(0))
    assert store.get_outcome_records(conn, run_id) == {1: OutcomeRecord(1, Accounting(), None)}


# -- schema 017: tasks_peak, and the 17-argument record_outcome of 0.6.x daemons -----------------------

def test_the_tasks_peak_is_kept_with_the_outcome_in_a_batch_too(conn: psycopg.Connection) -> None:
    first, a1 = claimed(conn)
    second, a2 = claimed(conn)
    fence = fence_of(conn, "h1")
    assert store.record_outcomes(conn, fence, [
        store.Settling(a1, SUCCEEDED, "succeeded", accounting=Accounting(tasks_peak=3)),
        store.Settling(a2, SUCCEEDED, "succeeded", accounting=MEASURED)]) == [True, True]
    assert store.get_outcome_records(conn, first)[1].accounting == Accounting(tasks_peak=3)
    assert conn.execute("SELECT tasks_peak FROM unitvisor.attempts WHERE run_id = %s", (second,)).fetchone() == (21,)


def test_the_old_seventeen_argument_call_by_position_records_no_tasks_peak(conn: psycopg.Connection) -> None:
    """Exactly the statement a 0.6.0 daemon sends (store.record_outcomes of 0.6.0), during a rolling upgrade."""
    run_id, attempt = claimed(conn)
    fence = fence_of(conn, "h1")
    with store._fencing():
        recorded = conn.execute(
            "SELECT unitvisor.record_outcome(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, "
            "%s::timestamptz)",
            (attempt.run_id, attempt.attempt, fence.host_id, fence.epoch, "success", "exit:0", "exited 0",
             "succeeded", None, "inv-1", None, None, 5, 6, 7, 8, store.host_clock())).fetchone()[0]
    assert recorded is True
    assert store.get_outcome_records(conn, run_id)[1].accounting == Accounting(5, 6, 7, 8, None)
    assert store.get_run(conn, run_id).state == "succeeded"


# -- the CLI: `show` prints them, `logs` answers from the kept tail on any other host ---------------

def ended_on_h1(conn: psycopg.Connection, cli, dsn: str, tail: str | None,
                accounting: Accounting = MEASURED) -> uuid.UUID:
    result = cli("submit", "--", "/bin/sh", "-c", "echo hi", dsn=dsn)
    assert result.returncode == 0, result.stderr
    run_id = uuid.UUID(result.stdout.strip())
    [(_, attempt)] = store.claim(conn, register(conn, "h1"), 1, unitspec.UNIT_NAME_FORMAT)
    fence = fence_of(conn, "h1")
    assert store.record_outcome(conn, fence, attempt, Outcome("exit-code", "exit:2", "exited 2"), "failed",
                                accounting=accounting)
    if tail is not None:
        assert store.record_output_tails(conn, fence, [(run_id, 1, tail)]) == 1
    return run_id


def test_show_prints_the_accounting_for_people_and_raw_in_json(conn: psycopg.Connection, cli, dsn: str) -> None:
    run_id = ended_on_h1(conn, cli, dsn, "a\nb")
    text = cli("show", str(run_id), dsn=dsn).stdout
    assert "    measured: 1.2s CPU, 34.0M peak memory, 0B read, 4096.0P written, 21 tasks at most\n" in text
    assert "not measured" not in text
    assert "    output:   the last 2 lines kept with the outcome\n" in text
    [attempt] = json.loads(cli("show", "--json", str(run_id), dsn=dsn).stdout)["attempts"]
    assert attempt["accounting"] == {"cpu_usage_nsec": 1_234_567_890, "memory_peak_bytes": 35_651_584,
                                     "io_read_bytes": 0, "io_write_bytes": 2**62, "tasks_peak": 21}
    assert attempt["not_measured"] == {}
    assert attempt["output_tail"] == "a\nb"


def test_show_of_an_attempt_with_nothing_measured(conn: psycopg.Connection, cli, dsn: str) -> None:
    run_id = ended_on_h1(conn, cli, dsn, None, Accounting())
    text = cli("show", str(run_id), dsn=dsn).stdout
    assert "    measured: -\n    not measured on its host: CPU (needs " in text
    [attempt] = json.loads(cli("show", "--json", str(run_id), dsn=dsn).stdout)["attempts"]
    assert attempt["accounting"] == dict.fromkeys(("cpu_usage_nsec", "memory_peak_bytes", "io_read_bytes",
                                                   "io_write_bytes", "tasks_peak"))
    assert list(attempt["not_measured"]) == ["cpu_usage_nsec", "memory_peak_bytes", "io_read_bytes",
                                             "io_write_bytes", "tasks_peak"]
    assert attempt["output_tail"] is None


def test_logs_on_another_host_prints_the_kept_tail_and_says_so(conn: psycopg.Connection, cli, dsn: str) -> None:
    run_id = ended_on_h1(conn, cli, dsn, "first\nünïcode ✓\nlast")
    result = cli("logs", str(run_id), dsn=dsn)  # this machine is not h1
    assert (result.returncode, result.stdout) == (0, "first\nünïcode ✓\nlast\n")
    assert result.stderr == ("attempt 1 on host h1: the last 3 lines of its output, kept with its outcome; the whole "
                             "output is in that host's journal while it keeps it\n")
    assert cli("logs", str(run_id), "-n", "2", dsn=dsn).stdout == "ünïcode ✓\nlast\n"
    assert cli("logs", str(run_id), "-n", "0", dsn=dsn).stdout == ""
    assert cli("logs", str(run_id), "--attempt", "1", dsn=dsn).stdout == "first\nünïcode ✓\nlast\n"


def test_logs_of_an_attempt_that_kept_nothing_on_another_host_says_where(conn: psycopg.Connection, cli,
                                                                         dsn: str) -> None:
    run_id = ended_on_h1(conn, cli, dsn, None)
    result = cli("logs", str(run_id), dsn=dsn)
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr.startswith(f"unitvisor: run {run_id} ran on host h1, not on this host (")
    assert result.stderr.endswith(f"), and no output was kept with its outcomes: run `journalctl "
                                  f"UNITVISOR_RUN={run_id}` there\n")
    assert result.stderr.count("\n") == 1


def test_logs_follow_of_an_attempt_running_on_another_host_says_where(conn: psycopg.Connection, cli,
                                                                      dsn: str) -> None:
    run_id = store.submit_run(conn, argv=["/bin/true"])
    store.claim(conn, register(conn, "h1"), 1, unitspec.UNIT_NAME_FORMAT)
    result = cli("logs", str(run_id), "--follow", dsn=dsn)
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == (f"unitvisor: attempt 1 of run {run_id} runs on host h1: run "
                             f"`journalctl UNITVISOR_RUN={run_id} UNITVISOR_ATTEMPT=1 --follow` there\n")

"""The `unitvisor` executable, run as a subprocess against the real database."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import psycopg
import pytest

from supervisor import store, unitspec
from supervisor.outcomes import Outcome
from tests.integration.conftest import assert_nothing_written, register, table_counts, table_exists

HOSTILE = "'; DROP TABLE unitvisor.runs; --"


def assert_one_line_error(result, code: int) -> str:
    """Exit `code`, exactly one line on stderr (no traceback), nothing on stdout; returns the line."""
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert len(result.stderr_lines) == 1, result.stderr
    assert result.stdout == ""
    line = result.stderr_lines[0]
    assert line.startswith("unitvisor: ")
    assert "Traceback" not in line and "internal error" not in line
    return line


def submit(cli, dsn: str, *args: str) -> uuid.UUID:
    result = cli("submit", *args, dsn=dsn)
    assert result.returncode == 0, result.stderr
    return uuid.UUID(result.stdout.strip())


def test_submit_prints_only_the_run_id(cli, dsn: str, conn: psycopg.Connection) -> None:
    register(conn, "h1")  # a live host that accepts it: else submit warns on stderr that none does
    result = cli("submit", "--memory", "256M", "--cpu", "50%", "--tasks", "32", "--",
                 "/bin/sh", "-c", "echo hi; exit 3", dsn=dsn)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout.count("\n") == 1 and result.stdout.endswith("\n")
    run_id = uuid.UUID(result.stdout.strip())
    assert result.stdout == f"{run_id}\n"

    run = store.get_run(conn, run_id)
    assert run is not None and run.state == "queued"
    assert run.argv == ["/bin/sh", "-c", "echo hi; exit 3"]
    assert (run.memory_max, run.cpu_quota_percent, run.tasks_max) == (256 << 20, 50, 32)
    jobs = conn.execute("SELECT state FROM unitvisor.spawn_jobs WHERE run_id = %s", (run_id,)).fetchall()
    assert jobs == [("available",)]
    assert table_counts(conn) == {"runs": 1, "spawn_jobs": 1, "run_events": 1, "attempts": 0, "hosts": 1}


def test_submit_with_every_option(cli, dsn: str, conn: psycopg.Connection) -> None:
    run_id = submit(cli, dsn, "--memory", "1G", "--cpu", "200%", "--tasks", "8", "--io-weight", "300",
                    "--runtime", "10m", "--max-attempts", "3", "--env", "A=1", "--env", "B=x=y",
                    "--workdir", "/srv", "--user", "nobody", "--host", "h7", "--priority", "5",
                    "--", "/usr/bin/env", "--ignore-environment", "-u", "X")
    run = store.get_run(conn, run_id)
    assert (run.memory_max, run.cpu_quota_percent, run.tasks_max, run.io_weight, run.runtime_max_sec) == (
        1 << 30, 200, 8, 300, 600)
    assert (run.max_attempts, run.environment, run.working_directory) == (3, {"A": "1", "B": "x=y"}, "/srv")
    assert (run.run_user, run.host_pin, run.priority) == ("nobody", "h7", 5)
    # Options after `--` belong to the command.
    assert run.argv == ["/usr/bin/env", "--ignore-environment", "-u", "X"]


def test_submit_private_network_is_stored_shown_and_in_json(cli, dsn: str, conn: psycopg.Connection) -> None:
    networkless = submit(cli, dsn, "--private-network", "--", "/bin/true")
    default = submit(cli, dsn, "--", "/bin/true")
    assert store.get_run(conn, networkless).private_network is True
    assert store.get_run(conn, default).private_network is False
    assert json.loads(cli("show", str(networkless), "--json", dsn=dsn).stdout)["private_network"] is True
    assert json.loads(cli("show", str(default), "--json", dsn=dsn).stdout)["private_network"] is False
    assert "  network:   none but loopback (--private-network)\n" in cli("show", str(networkless), dsn=dsn).stdout
    assert "  network:   the host's" in cli("show", str(default), dsn=dsn).stdout


def test_submit_stores_sql_looking_strings_verbatim(cli, dsn: str, conn: psycopg.Connection) -> None:
    run_id = submit(cli, dsn, "--env", f"X={HOSTILE}", "--workdir", f"/tmp/{HOSTILE}", "--host", HOSTILE,
                    "--", "/bin/echo", HOSTILE, "$(id)", "%s")
    run = store.get_run(conn, run_id)
    assert run.argv == ["/bin/echo", HOSTILE, "$(id)", "%s"]
    assert run.environment == {"X": HOSTILE}
    assert (run.working_directory, run.host_pin) == (f"/tmp/{HOSTILE}", HOSTILE)
    assert table_exists(conn, "unitvisor.runs")


@pytest.mark.parametrize("args", [
    pytest.param([], id="no-command"),
    pytest.param(["--"], id="no-command-after-dashes"),
    pytest.param(["--", "sh"], id="relative-path"),
    pytest.param(["--", "bin/sh", "-c", "true"], id="relative-path-with-slash"),
    pytest.param(["--memory", "12XB", "--", "/bin/true"], id="memory-bad-unit"),
    pytest.param(["--memory", "0", "--", "/bin/true"], id="memory-zero"),
    pytest.param(["--memory", "1K", "--", "/bin/true"], id="memory-too-small"),
    pytest.param(["--memory", "99999999T", "--", "/bin/true"], id="memory-absurd"),
    pytest.param(["--cpu", "0%", "--", "/bin/true"], id="cpu-zero"),
    pytest.param(["--cpu", "abc", "--", "/bin/true"], id="cpu-abc"),
    pytest.param(["--cpu", "100001%", "--", "/bin/true"], id="cpu-absurd"),
    pytest.param(["--tasks", "-1", "--", "/bin/true"], id="tasks-negative"),
    pytest.param(["--tasks", "0", "--", "/bin/true"], id="tasks-zero"),
    pytest.param(["--io-weight", "10001", "--", "/bin/true"], id="io-weight-absurd"),
    pytest.param(["--runtime", "0", "--", "/bin/true"], id="runtime-zero"),
    pytest.param(["--runtime", "soon", "--", "/bin/true"], id="runtime-bad"),
    pytest.param(["--max-attempts", "0", "--", "/bin/true"], id="max-attempts-zero"),
    pytest.param(["--env", "NOEQUALS", "--", "/bin/true"], id="env-no-equals"),
    pytest.param(["--env", "1BAD=x", "--", "/bin/true"], id="env-bad-name"),
    pytest.param(["--env", "=x", "--", "/bin/true"], id="env-empty-name"),
    pytest.param(["--env", "A=x\ny", "--", "/bin/true"], id="env-value-newline"),
    pytest.param(["--workdir", "tmp", "--", "/bin/true"], id="workdir-relative"),
    pytest.param(["--no-such-option", "--", "/bin/true"], id="unknown-option"),
])
def test_submit_bad_input_is_a_usage_error_and_writes_nothing(cli, dsn: str, conn: psycopg.Connection,
                                                              args: list[str]) -> None:
    assert_one_line_error(cli("submit", *args, dsn=dsn), 2)
    assert_nothing_written(conn)


def test_submit_env_name_with_a_trailing_newline_is_a_usage_error(cli, dsn: str, conn: psycopg.Connection) -> None:
    # Regression: the CLI's name check once ended in '$', which also matches before a trailing newline.
    result = cli("submit", "--env", "FOO\n=x", "--", "/bin/true", dsn=dsn)
    assert_nothing_written(conn)
    assert_one_line_error(result, 2)


def test_submit_priority_out_of_range_is_a_usage_error(cli, dsn: str, conn: psycopg.Connection) -> None:
    result = cli("submit", "--priority", "99999999999", "--", "/bin/true", dsn=dsn)
    assert_nothing_written(conn)
    assert_one_line_error(result, 2)


def test_a_run_refused_by_the_database_is_one_line_exit_1(cli, dsn: str, conn: psycopg.Connection) -> None:
    # The CLI does not check user names itself; the database's constraint refuses this one.
    line = assert_one_line_error(cli("submit", "--user", "Not A User", "--", "/bin/true", dsn=dsn), 1)
    assert "runs_run_user_valid" in line
    assert_nothing_written(conn)


def test_show_by_full_id_and_by_prefix(cli, dsn: str, conn: psycopg.Connection) -> None:
    run_id = submit(cli, dsn, "--memory", "256M", "--", "/bin/sh", "-c", "echo hi")
    full = cli("show", str(run_id), dsn=dsn)
    assert full.returncode == 0, full.stderr
    assert f"run {run_id}" in full.stdout
    assert "queued" in full.stdout and "memory=256M" in full.stdout
    by_prefix = cli("show", str(run_id)[:8], dsn=dsn)
    assert by_prefix.returncode == 0, by_prefix.stderr
    assert by_prefix.stdout == full.stdout
    upper = cli("show", str(run_id)[:8].upper(), dsn=dsn)
    assert upper.returncode == 0 and f"run {run_id}" in upper.stdout


def test_show_json(cli, dsn: str, conn: psycopg.Connection) -> None:
    run_id = submit(cli, dsn, "--memory", "256M", "--cpu", "50%", "--tasks", "32", "--",
                    "/bin/sh", "-c", "echo hi; exit 3")
    result = cli("show", "--json", str(run_id)[:8], dsn=dsn)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert {"state", "attempts", "limits"} <= set(data)
    assert data["id"] == str(run_id)
    assert data["state"] == "queued"
    assert data["attempts"] == []
    assert data["limits"] == {"memory_max": 256 << 20, "cpu_quota_percent": 50, "tasks_max": 32,
                              "io_weight": None, "runtime_max_sec": None, "memory_high": None}
    assert data["argv"] == ["/bin/sh", "-c", "echo hi; exit 3"]
    assert [e["state"] for e in data["events"]] == ["queued"]

    # Once a host has claimed it, the attempt shows up.
    [(_, attempt)] = store.claim(conn, register(conn, "h1", max_runs=10), 1, unitspec.UNIT_NAME_FORMAT)
    data = json.loads(cli("show", "--json", str(run_id), dsn=dsn).stdout)
    assert data["state"] == "starting"
    [shown] = data["attempts"]
    assert (shown["attempt"], shown["host"], shown["unit"], shown["outcome"]) == (1, "h1", attempt.unit_name, None)


def test_show_an_unknown_run(cli, dsn: str) -> None:
    unknown = str(uuid.uuid4())
    line = assert_one_line_error(cli("show", unknown, dsn=dsn), 1)
    assert unknown in line
    line = assert_one_line_error(cli("show", "abcdef12", dsn=dsn), 1)
    assert "abcdef12" in line


@pytest.mark.parametrize("hostile", [
    "'; DROP TABLE x; --",
    HOSTILE + " padding to be longer than thirty-two characters",
    "abcdef%",
    "abc_ef01",
    "abc",
    "",
    "../../etc/passwd",
])
def test_show_a_hostile_id_is_a_usage_error(cli, dsn: str, conn: psycopg.Connection, hostile: str) -> None:
    submit(cli, dsn, "--", "/bin/true")
    line = assert_one_line_error(cli("show", hostile, dsn=dsn), 2)
    assert "invalid run id" in line
    for table in ("unitvisor.runs", "unitvisor.spawn_jobs", "unitvisor.attempts"):
        assert table_exists(conn, table)
    assert table_counts(conn)["runs"] == 1


def test_an_ambiguous_prefix_lists_the_candidates(cli, dsn: str, conn: psycopg.Connection) -> None:
    a = uuid.UUID("abcdef01-0000-4000-8000-000000000001")
    b = uuid.UUID("abcdef02-0000-4000-8000-000000000002")
    conn.execute("INSERT INTO unitvisor.runs (id, argv) VALUES (%s, %s), (%s, %s)",
                 (a, ["/bin/true"], b, ["/bin/false"]))
    for command in ("show", "cancel"):
        line = assert_one_line_error(cli(command, "abcdef", dsn=dsn), 1)
        assert "ambiguous" in line and str(a) in line and str(b) in line
    assert store.get_run(conn, a).state == "queued" and store.get_run(conn, b).state == "queued"
    # One more character makes it unique.
    result = cli("show", "--json", "abcdef02", dsn=dsn)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["argv"] == ["/bin/false"]


def test_runs_json_lists_submitted_runs(cli, dsn: str, conn: psycopg.Connection) -> None:
    register(conn, "h1")  # a live host that accepts them: else `runs` says below its table why each waits
    empty = cli("runs", "--json", dsn=dsn)
    assert empty.returncode == 0 and json.loads(empty.stdout) == []
    ids = [submit(cli, dsn, "--", "/bin/echo", str(n)) for n in range(3)]
    result = cli("runs", "--json", dsn=dsn)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert {r["id"] for r in rows} == {str(i) for i in ids}
    assert all(r["state"] == "queued" and r["attempt"] is None for r in rows)
    assert {tuple(r["argv"]) for r in rows} == {("/bin/echo", str(n)) for n in range(3)}

    store.cancel_run(conn, ids[0])
    queued = json.loads(cli("runs", "--json", "--state", "queued", dsn=dsn).stdout)
    assert {r["id"] for r in queued} == {str(i) for i in ids[1:]}
    table = cli("runs", dsn=dsn)
    assert table.returncode == 0 and table.stdout.splitlines()[0].split()[:2] == ["ID", "STATE"]
    assert len(table.stdout.splitlines()) == 4


def test_runs_filters_by_host_and_age(cli, dsn: str, conn: psycopg.Connection) -> None:
    old = submit(cli, dsn, "--", "/bin/true")
    new = submit(cli, dsn, "--", "/bin/true")
    conn.execute("UPDATE unitvisor.runs SET created_at = now() - interval '2 hours' WHERE id = %s", (old,))
    store.claim(conn, register(conn, "h1", max_runs=10), 10, unitspec.UNIT_NAME_FORMAT)
    recent = json.loads(cli("runs", "--json", "--since", "1h", dsn=dsn).stdout)
    assert [r["id"] for r in recent] == [str(new)]
    on_h1 = json.loads(cli("runs", "--json", "--host", "h1", dsn=dsn).stdout)
    assert {r["id"] for r in on_h1} == {str(old), str(new)}
    assert all(r["host"] == "h1" and r["attempt"] == 1 for r in on_h1)
    assert json.loads(cli("runs", "--json", "--host", HOSTILE, dsn=dsn).stdout) == []
    assert_one_line_error(cli("runs", "--state", "bogus", dsn=dsn), 2)


def test_cancel_a_queued_run_then_again(cli, dsn: str, conn: psycopg.Connection) -> None:
    run_id = submit(cli, dsn, "--", "/bin/true")
    first = cli("cancel", str(run_id)[:8], dsn=dsn)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == f"run {run_id} cancelled"
    assert store.get_run(conn, run_id).state == "cancelled"
    assert conn.execute("SELECT count(*) FROM unitvisor.spawn_jobs").fetchone()[0] == 0

    line = assert_one_line_error(cli("cancel", str(run_id), dsn=dsn), 1)
    assert "already cancelled" in line
    assert_one_line_error(cli("cancel", str(uuid.uuid4()), dsn=dsn), 1)


def test_cancel_a_running_run_asks_its_host(cli, dsn: str, conn: psycopg.Connection) -> None:
    run_id = submit(cli, dsn, "--", "/bin/true")
    [(_, attempt)] = store.claim(conn, register(conn, "h1", max_runs=10), 1, unitspec.UNIT_NAME_FORMAT)
    store.mark_started(conn, store.Fence("h1", 1), attempt, "inv")
    result = cli("cancel", str(run_id), dsn=dsn)
    assert result.returncode == 0, result.stderr
    assert "cancel requested" in result.stdout
    run = store.get_run(conn, run_id)
    assert run.state == "running" and run.cancel_requested_at is not None


@pytest.mark.parametrize("args", [
    ["runs"], ["show", "abcdef12"], ["cancel", "abcdef12"], ["migrate"], ["submit", "--", "/bin/true"],
])
@pytest.mark.parametrize("how", ["flag", "env"])
def test_an_unreachable_database_is_one_line_without_the_password(cli, args: list[str], how: str) -> None:
    bad = "host=127.0.0.1 port=1 user=u password=SECRETPW dbname=x"
    result = cli("--dsn", bad, *args) if how == "flag" else cli(*args, dsn=bad)
    line = assert_one_line_error(result, 1)
    assert "127.0.0.1:1" in line
    assert "SECRETPW" not in result.stderr + result.stdout


def test_a_missing_database_does_not_leak_the_password(cli, postgres) -> None:
    bad = f"host=127.0.0.1 port={postgres.port} user=postgres password=SECRETPW dbname=no_such_db"
    line = assert_one_line_error(cli("--dsn", bad, "runs"), 1)
    assert f"127.0.0.1:{postgres.port}" in line
    assert "SECRETPW" not in line


def test_a_config_file_that_does_not_parse(cli, dsn: str, conn: psycopg.Connection, tmp_path: Path) -> None:
    bad = tmp_path / "broken.toml"
    bad.write_text("[host\nid = \n")
    for args in (["runs"], ["submit", "--", "/bin/true"]):
        line = assert_one_line_error(cli("--dsn", dsn, *args, config=bad), 1)
        assert str(bad) in line
    assert_nothing_written(conn)


def test_a_config_file_that_does_not_exist(cli, dsn: str, tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    line = assert_one_line_error(cli("runs", dsn=dsn, config=missing), 1)
    assert str(missing) in line


def test_no_database_configured(cli, tmp_path: Path) -> None:
    config = tmp_path / "unitvisor.toml"
    config.write_text(f'[database]\ndsn_file = "{tmp_path / "no-dsn-file"}"\n')
    line = assert_one_line_error(cli("runs", config=config), 1)
    assert "no database configured" in line


def test_dsn_from_the_config_file(cli, dsn: str, conn: psycopg.Connection, tmp_path: Path) -> None:
    config = tmp_path / "unitvisor.toml"
    config.write_text(f'[database]\ndsn = "{dsn}"\n')
    result = cli("submit", "--", "/bin/true", config=config)
    assert result.returncode == 0, result.stderr
    assert store.get_run(conn, uuid.UUID(result.stdout.strip())) is not None


# -- labels and idempotency keys (schema 005) ------------------------------------------------------------


def test_submit_with_labels_and_find_them_again(cli, dsn: str, conn: psycopg.Connection) -> None:
    tagged = submit(cli, dsn, "--label", "team=infra", "--label", "job=backup", "--", "/bin/true")
    submit(cli, dsn, "--label", "team=web", "--", "/bin/true")
    assert store.get_run(conn, tagged).labels == {"team": "infra", "job": "backup"}

    listed = cli("runs", "--label", "team=infra", "--json", dsn=dsn)
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert [r["id"] for r in rows] == [str(tagged)]
    assert rows[0]["labels"] == {"team": "infra", "job": "backup"}
    both = cli("runs", "--label", "team=infra", "--label", "job=nope", "--json", dsn=dsn)
    assert json.loads(both.stdout) == []

    shown = cli("show", str(tagged), dsn=dsn)
    assert "  labels:    job=backup team=infra" in shown.stdout.splitlines()
    assert json.loads(cli("show", str(tagged), "--json", dsn=dsn).stdout)["labels"] == {
        "team": "infra", "job": "backup"}


def test_runs_by_label_says_what_the_sql_status_read_says(cli, dsn: str, conn: psycopg.Connection) -> None:
    """`runs --label` and unitvisor.runs_with_labels: the same runs, in the same order, with the same
    status, for each way a run can stand (queued, claimed, failed, cancelled, expired)."""
    fence = register(conn, "h1")
    ids = [submit(cli, dsn, "--label", "team=infra", "--start-deadline", "+1h", "--", "/bin/true") for _ in range(5)]
    submit(cli, dsn, "--label", "team=web", "--", "/bin/true")
    (claimed_run, attempt), *_ = store.claim(conn, fence, 1, unitspec.UNIT_NAME_FORMAT)
    store.record_outcome(conn, fence, attempt, Outcome("exit-code", "exit:3", "exited 3"), "failed")
    store.claim(conn, fence, 1, unitspec.UNIT_NAME_FORMAT)  # claimed, not started
    store.cancel_run(conn, ids[2])
    conn.execute("UPDATE unitvisor.runs SET start_deadline = now() - interval '1 second' WHERE id = %s", (ids[3],))
    store.expire_runs(conn, fence)

    rows = json.loads(cli("runs", "--label", "team=infra", "--json", dsn=dsn).stdout)
    statuses = store.runs_with_labels(conn, {"team": "infra"})
    assert len(statuses) == 5
    assert [(r["id"], r["state"], r["host"], r["attempt"], r["outcome"], r["exit_status"]) for r in rows] == [
        (str(s.id), s.state, s.host_id, s.attempt, s.outcome, s.exit_status) for s in statuses]
    assert {s.state for s in statuses} == {"queued", "starting", "failed", "cancelled", "expired"}


def test_a_repeated_submit_with_an_idempotency_key_prints_the_first_run(cli, dsn: str,
                                                                        conn: psycopg.Connection) -> None:
    first = submit(cli, dsn, "--idempotency-key", "deploy-17", "--", "/bin/true")
    assert submit(cli, dsn, "--idempotency-key", "deploy-17", "--", "/bin/true") == first
    assert table_counts(conn)["runs"] == 1


@pytest.mark.parametrize("label", ["novalue", "-bad=x", "k=" + "v" * 256])
def test_a_bad_label_is_a_usage_error_before_any_write(cli, dsn: str, conn: psycopg.Connection, label: str) -> None:
    result = cli("submit", "--label", label, "--", "/bin/true", dsn=dsn)
    assert result.returncode == 2 and "--label" in result.stderr
    assert_nothing_written(conn)


# -- concurrency keys, not_before and start deadlines (schema 006) -----------------------------------


def test_submit_with_a_concurrency_key_and_times_shows_them(cli, dsn: str, conn: psycopg.Connection) -> None:
    register(conn, "h1")  # a live host that accepts it: its not_before is then the one reason it waits
    run_id = submit(cli, dsn, "--concurrency-key", "nightly-backup", "--not-before", "2099-06-01T03:00:00+02:00",
                    "--start-deadline", "2099-06-01T05:00Z", "--", "/bin/true")
    run = store.get_run(conn, run_id)
    assert run.concurrency_key == "nightly-backup"
    assert run.not_before.isoformat() == "2099-06-01T01:00:00+00:00"
    assert run.start_deadline.isoformat() == "2099-06-01T05:00:00+00:00"

    data = json.loads(cli("show", str(run_id), "--json", dsn=dsn).stdout)
    assert (data["concurrency_key"], data["not_before"], data["start_deadline"]) == (
        "nightly-backup", "2099-06-01T01:00:00+00:00", "2099-06-01T05:00:00+00:00")
    assert data["wait_reason"] == "not before 2099-06-01 01:00:00 UTC"
    shown = cli("show", str(run_id), dsn=dsn).stdout
    assert ("  start:     concurrency key nightly-backup; not before 2099-06-01T01:00:00+00:00; "
            "start deadline 2099-06-01T05:00:00+00:00") in shown
    assert "  waiting:   not before 2099-06-01 01:00:00 UTC" in shown
    [row] = json.loads(cli("runs", "--json", dsn=dsn).stdout)
    assert (row["concurrency_key"], row["not_before"], row["start_deadline"]) == (
        "nightly-backup", "2099-06-01T01:00:00+00:00", "2099-06-01T05:00:00+00:00")


def test_a_relative_time_counts_from_the_databases_clock(cli, dsn: str, conn: psycopg.Connection) -> None:
    run_id = submit(cli, dsn, "--not-before", "+10m", "--start-deadline", "+1h", "--", "/bin/true")
    ahead = conn.execute("SELECT extract(epoch FROM not_before - created_at), "
                         "extract(epoch FROM start_deadline - created_at) FROM unitvisor.runs WHERE id = %s",
                         (run_id,)).fetchone()
    # now() of the CLI's own look-up, a moment before the submit's transaction began
    assert 590 < ahead[0] <= 600 and 3590 < ahead[1] <= 3600


def test_show_of_a_run_without_them_has_no_start_line(cli, dsn: str) -> None:
    run_id = submit(cli, dsn, "--", "/bin/true")
    assert "  start:" not in cli("show", str(run_id), dsn=dsn).stdout


@pytest.mark.parametrize(("args", "option"), [
    (["--not-before", "tomorrow"], "--not-before"),
    (["--not-before", "+"], "--not-before"),
    (["--start-deadline", "2026-13-01"], "--start-deadline"),
    (["--start-deadline", "+0s"], "--start-deadline"),
    (["--concurrency-key", ""], "--concurrency-key"),
    (["--concurrency-key", "a\tb"], "--concurrency-key"),
    (["--concurrency-key", "k" * 256], "--concurrency-key"),
    (["--not-before", "+2h", "--start-deadline", "+1h"], "--start-deadline"),
    (["--not-before", "2099-01-01T00:00Z", "--start-deadline", "2099-01-01T00:00Z"], "--start-deadline"),
])
def test_bad_times_and_keys_are_usage_errors_before_any_write(cli, dsn: str, conn: psycopg.Connection,
                                                             args: list[str], option: str) -> None:
    line = assert_one_line_error(cli("submit", *args, "--", "/bin/true", dsn=dsn), 2)
    assert line.startswith(f"unitvisor: {option}: ")
    assert_nothing_written(conn)


def test_a_deadline_in_the_past_is_refused_by_the_database(cli, dsn: str, conn: psycopg.Connection) -> None:
    line = assert_one_line_error(cli("submit", "--start-deadline", "2000-01-01T00:00Z", "--", "/bin/true", dsn=dsn), 1)
    assert line == ("unitvisor: the database refused the run: start_deadline: must be in the future (it is not "
                    "after the database's now()) (runs_start_deadline_valid)")
    assert_nothing_written(conn)


def test_an_expired_run_is_listed_shown_and_waited_for(cli, dsn: str, conn: psycopg.Connection) -> None:
    run_id = submit(cli, dsn, "--start-deadline", "+1h", "--", "/bin/true")
    conn.execute("UPDATE unitvisor.runs SET start_deadline = now() - interval '1 second' WHERE id = %s", (run_id,))
    store.expire_runs(conn, register(conn, "h1"))
    waited = cli("wait", str(run_id), dsn=dsn)
    assert (waited.returncode, waited.stdout) == (1, f"run {run_id} expired\n")
    listed = cli("runs", "--state", "expired", "--json", dsn=dsn)
    assert [(r["id"], r["state"], r["outcome"]) for r in json.loads(listed.stdout)] == [
        (str(run_id), "expired", "expired")]  # as unitvisor.run_status says it, not the (absent) attempt's
    [header, line] = cli("runs", dsn=dsn).stdout.splitlines()
    assert dict(zip(header.split(), line.split(), strict=True))["OUTCOME"] == "expired"
    shown = cli("show", str(run_id), dsn=dsn).stdout
    assert "  state:     expired" in shown and "expired: not started by its start deadline" in shown
    assert "  waiting:" not in shown
    cancelled = cli("cancel", str(run_id), dsn=dsn)
    assert cancelled.returncode == 1 and "already expired" in cancelled.stderr
    resumed = cli("resume", str(run_id), dsn=dsn)
    assert (resumed.returncode, resumed.stdout) == (0, f"run {run_id} queued again\n")

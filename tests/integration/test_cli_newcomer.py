"""What a newcomer meets first, against the real executable and a real PostgreSQL: a database
without the schema (or behind it), global options after the command, and `wait` losing its database."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import psycopg
import pytest

from supervisor import store
from tests.integration.conftest import table_counts, unitvisor_command
from tests.integration.test_cli_db import assert_one_line_error, submit

# Every command that reads or writes the database, with arguments that would be fine on a migrated one.
DATABASE_COMMANDS = [
    pytest.param(["runs"], id="runs"),
    pytest.param(["runs", "--json"], id="runs-json"),
    pytest.param(["submit", "--memory", "256M", "--", "/bin/true"], id="submit"),
    pytest.param(["show", "abcdef12"], id="show"),
    pytest.param(["show", "--json", str(uuid.UUID(int=7))], id="show-json"),
    pytest.param(["cancel", "abcdef12"], id="cancel"),
    pytest.param(["resume", "abcdef12"], id="resume"),
    pytest.param(["wait", "abcdef12", "--timeout", "5s"], id="wait"),
    pytest.param(["logs", "abcdef12"], id="logs"),
    pytest.param(["hosts"], id="hosts"),
    pytest.param(["hosts", "--json"], id="hosts-json"),
    pytest.param(["hosts", "forget", "web-7"], id="hosts-forget"),
    pytest.param(["hosts", "confirm-down", "web-7"], id="hosts-confirm-down"),
    pytest.param(["drain", "web-7"], id="drain"),
    pytest.param(["undrain", "web-7"], id="undrain"),
    pytest.param(["reconcile", "--dry-run"], id="reconcile"),
]


def assert_says_migrate(line: str) -> None:
    assert "run `unitvisor migrate`" in line, line
    assert "UndefinedTable" not in line and "internal error" not in line


@pytest.mark.parametrize("args", DATABASE_COMMANDS)
def test_every_command_on_an_empty_database_says_run_migrate(cli, empty_dsn: str, args: list[str]) -> None:
    line = assert_one_line_error(cli(*args, dsn=empty_dsn), 1)
    assert_says_migrate(line)
    assert "has no unitvisor schema yet" in line
    with store.connect(empty_dsn) as conn:
        assert store.pending_migrations(conn) == [v for v, _ in store.migration_files()]  # nothing written


def test_doctor_on_an_empty_database_says_run_migrate(cli, empty_dsn: str) -> None:
    result = cli("doctor", dsn=empty_dsn)
    assert result.returncode == 1
    [schema] = [line for line in result.stdout.splitlines() if " schema " in f" {line} "]
    assert schema.startswith("fail") and "run `unitvisor migrate`" in schema


@pytest.fixture
def behind_dsn(empty_dsn: str, tmp_path: Path) -> str:
    """A database with only the first migration applied: what an upgraded CLI meets before `migrate`."""
    first_only = tmp_path / "sql"
    first_only.mkdir()
    (version, path), *rest = store.migration_files()
    assert rest, "this test needs at least two migrations"
    shutil.copy(path, first_only / path.name)
    with store.connect(empty_dsn) as conn:
        assert store.migrate(conn, first_only) == [version]
    return empty_dsn


@pytest.mark.parametrize("args", DATABASE_COMMANDS)
def test_every_command_on_a_database_behind_says_run_migrate(cli, behind_dsn: str, args: list[str]) -> None:
    line = assert_one_line_error(cli(*args, dsn=behind_dsn), 1)
    assert_says_migrate(line)
    missing = [v for v, _ in store.migration_files()][1:]
    assert f"lacks migration{'s' if len(missing) > 1 else ''} {', '.join(missing)}" in line


def test_migrate_then_every_command_works(cli, behind_dsn: str) -> None:
    result = cli("migrate", dsn=behind_dsn)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("applied: ")
    run_id = submit(cli, behind_dsn, "--", "/bin/true")
    shown = cli("show", str(run_id), dsn=behind_dsn)
    assert shown.returncode == 0, shown.stderr


def test_migrate_on_an_empty_database(cli, empty_dsn: str) -> None:
    result = cli("migrate", dsn=empty_dsn)
    assert result.returncode == 0, result.stderr
    assert cli("runs", dsn=empty_dsn).returncode == 0


# -- global options after the command, with the real parser and database --------------------------


def test_dsn_after_the_command(cli, dsn: str, conn: psycopg.Connection) -> None:
    bad = "host=127.0.0.1 port=1 dbname=x"
    # The environment's DSN is unreachable; the one after the command is used.
    result = cli("submit", "--dsn", dsn, "--memory", "64M", "--", "/bin/echo", "--dsn", bad, "--debug", dsn=bad)
    assert result.returncode == 0, result.stderr
    run = store.get_run(conn, uuid.UUID(result.stdout.strip()))
    assert run.argv == ["/bin/echo", "--dsn", bad, "--debug"]
    listed = cli("runs", "--json", "--dsn", dsn, dsn=bad)
    assert listed.returncode == 0 and str(run.id) in listed.stdout
    assert_one_line_error(cli("runs", "--dsn", bad, dsn=dsn), 1)


def test_debug_after_the_command_is_not_a_usage_error(cli, dsn: str) -> None:
    result = cli("runs", "--debug", dsn=dsn)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ID")


# -- wait: "could not tell" is its own exit code -----------------------------------------------------


def test_wait_on_a_closed_port_exits_75(cli) -> None:
    line = assert_one_line_error(cli("wait", "abcdef12", dsn="host=127.0.0.1 port=1 dbname=x"), 75)
    assert "cannot tell how run abcdef12 ends" in line and "127.0.0.1:1" in line


def test_wait_exits_75_when_the_database_goes_away(dsn: str, conn: psycopg.Connection, empty_config: Path) -> None:
    run_id = store.submit_run(conn, argv=["/bin/true"])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UNITVISOR_", "PG"))}
    env["UNITVISOR_DSN"] = dsn
    command, extra = unitvisor_command()
    env.update(extra)
    proc = subprocess.Popen([*command, "--config", str(empty_config), "wait", str(run_id)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
    try:
        # Its session, once it is polling (its last statement is run_status); then the database ends it,
        # as a restart or failover would. Any other session of the database would not do: CI's loaded
        # PyPI pass once found another, killed it a second later, before the wait had even connected,
        # and the wait then waited for ever.
        deadline = time.monotonic() + 20
        pids: list[int] = []
        while not pids and time.monotonic() < deadline:
            pids = [row[0] for row in conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() "
                "AND application_name = 'unitvisor' AND query LIKE '%%unitvisor.run_status(%%'")]
            time.sleep(0.1)
        assert pids, "the wait never polled"
        for pid in pids:
            conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 75, (out, err)
    assert out == ""
    [line] = err.splitlines()
    assert line.startswith(f"unitvisor: cannot tell how run {run_id} ends: lost the database while waiting")
    assert table_counts(conn)["runs"] == 1 and store.get_run(conn, run_id).state == "queued"


def test_wait_exit_codes_0_1_124(cli, dsn: str, conn: psycopg.Connection) -> None:
    run_id = submit(cli, dsn, "--", "/bin/true")
    timed_out = cli("wait", str(run_id), "--timeout", "1s", dsn=dsn)
    assert timed_out.returncode == 124 and "still queued" in timed_out.stderr
    store.cancel_run(conn, run_id)
    cancelled = cli("wait", str(run_id), dsn=dsn)
    assert cancelled.returncode == 1 and cancelled.stdout == f"run {run_id} cancelled\n"

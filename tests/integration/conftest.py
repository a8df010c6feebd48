"""Shared helpers for the integration tests: a real PostgreSQL (the `postgres`, `dsn` and `conn`
fixtures of tests/conftest.py), the real `unitvisor` executable, and no mocks anywhere."""

from __future__ import annotations

import os
import select
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from tests.conftest import throwaway_database
from tests.harness.host import REPO
from tests.harness.postgres import Postgres

UNITVISOR = REPO / ".venv" / "bin" / "unitvisor"
TABLES = ("runs", "spawn_jobs", "run_events", "attempts", "hosts")


def table_counts(conn: psycopg.Connection) -> dict[str, int]:
    """Rows in each unitvisor table."""
    return {t: conn.execute(f"SELECT count(*) FROM unitvisor.{t}").fetchone()[0] for t in TABLES}


def assert_nothing_written(conn: psycopg.Connection) -> None:
    assert table_counts(conn) == dict.fromkeys(TABLES, 0)


def table_exists(conn: psycopg.Connection, name: str) -> bool:
    return conn.execute("SELECT to_regclass(%s) IS NOT NULL", (name,)).fetchone()[0]


@dataclass(frozen=True)
class Note:
    channel: str
    payload: str


def wait_notifies(conn: psycopg.Connection, timeout: float = 5.0, count: int = 1) -> list[Note]:
    """Up to `count` notifications received by a LISTENing connection within `timeout` seconds.

    Through libpq directly, as the daemon reads them: psycopg 3.1 (Debian bookworm) has no
    `notifies(timeout=...)`."""
    notes: list[Note] = []
    deadline = time.monotonic() + timeout
    while len(notes) < count:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        select.select([conn.fileno()], [], [], remaining)
        conn.pgconn.consume_input()
        while (note := conn.pgconn.notifies()) is not None:
            notes.append(Note(note.relname.decode(), note.extra.decode()))
    return notes[:count] if len(notes) > count else notes


@dataclass(frozen=True)
class CliResult:
    returncode: int
    stdout: str
    stderr: str

    @property
    def stderr_lines(self) -> list[str]:
        return self.stderr.splitlines()


@pytest.fixture
def empty_dsn(postgres: Postgres) -> Iterator[str]:
    """A brand-new database without the unitvisor schema (cloned from the empty template1)."""
    with throwaway_database(postgres) as new_dsn:
        yield new_dsn


@pytest.fixture
def empty_config(tmp_path: Path) -> Path:
    """An empty (valid) config file, so that the CLI never reads the machine's /etc/unitvisor."""
    path = tmp_path / "unitvisor.toml"
    path.write_text("")
    return path


@pytest.fixture
def cli(empty_config: Path) -> Callable[..., CliResult]:
    """Run the real `unitvisor` executable as a subprocess.

    `dsn` goes into $UNITVISOR_DSN (the environment is otherwise scrubbed of UNITVISOR_* and PG*);
    `config` defaults to an empty file.
    """

    def run(*args: str, dsn: str | None = None, config: Path | None = None, timeout: float = 60) -> CliResult:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("UNITVISOR_", "PG"))}
        if dsn is not None:
            env["UNITVISOR_DSN"] = dsn
        cmd = [str(UNITVISOR), "--config", str(config or empty_config), *args]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd="/")
        return CliResult(proc.returncode, proc.stdout, proc.stderr)

    return run

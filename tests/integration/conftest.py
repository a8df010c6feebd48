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

from supervisor import envpolicy, globs, store
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


# -- hosts: a host must be registered before it claims -------------------------------------------

# Any absolute path of up to three components: /bin/true, /usr/bin/env, /usr/local/bin/x.
ALLOW_ALL = ("/*", "/*/*", "/*/*/*")


def host_profile(host: str = "h1", *, max_runs: int = 1000, budget: int | None = None,
                 allowed: tuple[str, ...] = ALLOW_ALL, users: tuple[str, ...] = (), run_user: str = "",
                 instance: str | None = None, can_start: bool = True, cannot_start_reason: str | None = None,
                 poll_interval: float = 10.0, dead_after: float = 60.0, name: str | None = None,
                 version: str = "0.0-test", boot_id: str = "boot-test",
                 allowed_environment: tuple[str, ...] = ()) -> store.HostProfile:
    """What a daemon would register, with the allowlist's regexes made as the daemon makes them."""
    return store.HostProfile(
        host_id=host, name=name or f"box-{host}", instance=instance or f"inst-{host}", max_runs=max_runs,
        memory_budget=budget, version=version, boot_id=boot_id, allowed_executables=tuple(allowed),
        executable_patterns=tuple(globs.glob_regex(p) for p in allowed), run_user=run_user,
        allowed_users=tuple(users), environment_denied=envpolicy.denied_regexes(),
        environment_allowed=envpolicy.allowed_regexes(allowed_environment), can_start=can_start,
        cannot_start_reason=cannot_start_reason,
        poll_interval=poll_interval, dead_after=dead_after)


def register(conn: psycopg.Connection, host: str = "h1", **profile: object) -> store.Fence:
    """Register (or re-register: same instance, same epoch) a host and return its fence.

    register_host takes a session-level lock on the host id: use one connection per host id (or
    the same connection again), as a daemon does."""
    registration = store.register_host(conn, host_profile(host, **profile))  # type: ignore[arg-type]
    assert registration.registered, registration.detail
    return store.Fence(host, registration.epoch)


def fence_of(conn: psycopg.Connection, host: str) -> store.Fence:
    """The host's current fence, as the database holds it (without registering again)."""
    found = store.host_fence(conn, host)
    assert found is not None, f"host {host} is not registered"
    return found[1]


def silence(conn: psycopg.Connection, host: str, seconds: float) -> None:
    """Pretend the host was last heard from `seconds` ago (by the database's clock)."""
    conn.execute("UPDATE unitvisor.hosts SET heartbeat_at = now() - make_interval(secs => %s) WHERE id = %s",
                 (seconds, host))


def age_jobs(conn: psycopg.Connection, seconds: float = 60.0) -> None:
    """Make every available job due since `seconds` ago: older than spread_grace, so that a claim is
    not held to its host's fair share (and younger than starve_after, so backfill is unchanged)."""
    conn.execute("UPDATE unitvisor.spawn_jobs SET scheduled_at = now() - make_interval(secs => %s) "
                 "WHERE state = 'available'", (seconds,))


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

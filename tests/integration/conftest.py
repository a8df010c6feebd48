"""Shared helpers for the integration tests: a real PostgreSQL (the `postgres`, `dsn` and `conn`
fixtures of tests/conftest.py), the real `unitvisor` executable, and no mocks anywhere."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest
from psycopg import sql

from supervisor import envpolicy, globs, store
from tests.conftest import throwaway_database
from tests.harness.host import REPO
from tests.harness.postgres import Postgres

UNITVISOR = REPO / ".venv" / "bin" / "unitvisor"


def unitvisor_command() -> tuple[list[str], dict[str, str]]:
    """The real executable, and what its environment needs besides: the checkout's virtualenv's
    `unitvisor`; or, where the tests run outside the checkout's virtualenvs (`make test-trixie` in the
    trixie chroot, on trixie's python3 and packages), that python3 running the same entry point
    (`python3 -m supervisor`) with the checkout on its path. .venv's script would start .venv's
    python, which is this machine's Python 3.11 with its packages, not trixie's: it could not even
    import them there, and every CLI test failed."""
    if Path(sys.prefix).resolve().is_relative_to(REPO):
        return [str(UNITVISOR)], {}
    return [sys.executable, "-m", "supervisor"], {"PYTHONPATH": str(REPO)}
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
                 allowed_environment: tuple[str, ...] = ("*",)) -> store.HostProfile:
    """What a daemon would register, with the allowlist's regexes made as the daemon makes them. The
    default environment allowlist, `*`, opens every name but the denylist's: the tests of other behaviour
    submit whatever names they like; those of the allowlist (test_environment_claims.py) name theirs."""
    return store.HostProfile(
        host_id=host, name=name or f"box-{host}", instance=instance or f"inst-{host}", max_runs=max_runs,
        memory_budget=budget, version=version, boot_id=boot_id, allowed_executables=tuple(allowed),
        executable_patterns=tuple(globs.glob_regex(p) for p in allowed), run_user=run_user,
        allowed_users=tuple(users), environment_denied=envpolicy.denied_regexes(),
        environment_names=envpolicy.allowed_names(allowed_environment),
        environment_patterns=envpolicy.allowed_pattern_regexes(allowed_environment), can_start=can_start,
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


# How much longer than `silence` set a host may have been silent when it is declared: the moment between
# the two, which a loaded machine once made over 0.5 s (rounding the silence did not absorb it).
SILENCE_SLACK = 5


def declared(dead: Iterable[Any], silenced: dict[str, float]) -> list[tuple[str, float]]:
    """The declared hosts as (host, dead_after), each checked to have been silent for what `silence`
    set, give or take SILENCE_SLACK."""
    dead = list(dead)
    for d in dead:
        assert silenced[d.host_id] <= d.silent < silenced[d.host_id] + SILENCE_SLACK, (d, silenced)
    return sorted((d.host_id, d.dead_after) for d in dead)


def silence_said(text: str, seconds: int) -> str:
    """`text` with the "silent for N s" (whole seconds) that `silence(..., seconds)` led to said as
    `seconds` when N is within SILENCE_SLACK of it, so that a test can compare the whole text."""
    return re.sub(r"silent for (\d+) s",
                  lambda m: f"silent for {seconds} s" if seconds <= int(m[1]) < seconds + SILENCE_SLACK else m[0],
                  text)


def look_again(conn: psycopg.Connection) -> None:
    """Pretend the fleet's last look for upkeep that found none was long ago (040, upkeep_looks): a
    heartbeat now looks again, as the first one a poll interval later would."""
    conn.execute("UPDATE unitvisor.fleet_upkeep SET looked_at = '-infinity'")


T = TypeVar("T")


def _function_calls(conn: psycopg.Connection) -> dict[str, int]:
    return dict(conn.execute("SELECT funcname::text, calls FROM pg_stat_xact_user_functions "
                             "WHERE schemaname = 'unitvisor'").fetchall())


def calls_during(conn: psycopg.Connection, action: Callable[[], T], *, commit: bool) -> tuple[T, dict[str, int]]:
    """`action` in a transaction of its own (rolled back unless `commit`): its result, and the calls of each
    unitvisor function it made. As a difference: the view also shows the session's counts not yet sent to
    the statistics (PostgreSQL 15 sends them at most once a second), so a second call within the second
    saw the first's too."""
    with conn.transaction(force_rollback=not commit):
        conn.execute("SET LOCAL track_functions = 'all'")
        before = _function_calls(conn)
        result = action()
        after = _function_calls(conn)
    return result, {name: n - before.get(name, 0) for name, n in after.items() if n > before.get(name, 0)}


def forget_work_marks(conn: psycopg.Connection) -> None:
    """After a test moved a job's time or a run's state by hand, as no writer of the product does: the
    heartbeats' "no work" marks (041, work_mark) are forgotten, so that the next heartbeat walks the queue
    again, as it does after the same change made by a submit, an outcome or the clock."""
    conn.execute("UPDATE unitvisor.hosts SET work_mark = NULL")


def connected(conn: psycopg.Connection, host: str, seconds: float = 3600.0) -> None:
    """Pretend the host registered `seconds` ago (by the database's clock): declare_dead_hosts measures
    how long a declarer has been connected by its registration's age, not by what the caller says
    (sql/013_fleet_promises.sql)."""
    conn.execute("UPDATE unitvisor.hosts SET started_at = now() - make_interval(secs => %s) WHERE id = %s",
                 (seconds, host))


def age_jobs(conn: psycopg.Connection, seconds: float = 60.0) -> None:
    """Make every available job due since `seconds` ago: older than spread_grace, so that a claim is
    not held to its host's fair share (and younger than starve_after, so backfill is unchanged)."""
    conn.execute("UPDATE unitvisor.spawn_jobs SET scheduled_at = now() - make_interval(secs => %s) "
                 "WHERE state = 'available'", (seconds,))


def run_concurrently(worker: Callable[[str], None], names: tuple[str, ...], timeout: float = 120) -> None:
    """worker(name) in one thread per name, started together; the first exception a worker raised is
    raised here once all have ended (an assert in a thread would otherwise only print)."""
    errors: list[BaseException] = []

    def guarded(name: str) -> None:
        try:
            worker(name)
        except BaseException as exc:  # reported by the calling thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)
    assert not errors, errors


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
        command, extra = unitvisor_command()
        env.update(extra)
        cmd = [*command, "--config", str(config or empty_config), *args]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd="/")
        return CliResult(proc.returncode, proc.stdout, proc.stderr)

    return run


# -- the store's host paths, run as bound host roles -----------------------------------------------
#
# The modules that exercise the daemon's queries (claim, start, outcome, retry, heartbeat, dead hosts,
# stop) use `pytestmark = pytest.mark.usefixtures("as_bound_roles")`, and so run twice: as the
# superuser, and with every host call of the store made as a login role bound to that call's host id
# (and submit, cancel and resume as a unitvisor_submitter login role). The tests share one connection
# between several host ids and the operator's own setup statements, so each such call switches the
# session's login role around itself with SET SESSION AUTHORIZATION: session_user becomes the bound
# role exactly as a login of that role makes it, and session_user is what the database checks
# (unitvisor.require_host, the policy on runs). tests/integration/test_roles.py logs in for real.

# A host id no test registers: the role for host calls that name no host (explain_waiting, ...).
ANY_HOST = "any-host"
TEST_SUBMITTER = "uvtest_submitter"
_HOST_CALLS = {  # store function -> how to find the host id it acts as
    "register_host": lambda args: args[1].host_id,
    "probe": lambda args: args[1].host_id, "mark_host_stopped": lambda args: args[1].host_id,
    "declare_dead_hosts": lambda args: args[1].host_id, "claim": lambda args: args[1].host_id,
    "mark_started": lambda args: args[1].host_id, "mark_started_many": lambda args: args[1].host_id,
    "record_outcome": lambda args: args[1].host_id, "record_outcomes": lambda args: args[1].host_id,
    "record_event": lambda args: args[1].host_id, "expire_runs": lambda args: args[1].host_id,
    "mark_warned": lambda args: args[1].host_id,
    "open_attempts": lambda args: args[1], "host_fence": lambda args: args[1],
    "explain_waiting": lambda args: ANY_HOST, "unit_owners": lambda args: ANY_HOST,
    "unclaimed_attempts": lambda args: ANY_HOST,
    "freeze_requests": lambda args: args[1].host_id, "record_freeze": lambda args: args[1].host_id,
    "pass_figures": lambda args: args[1].host_id, "register_wake_channel": lambda args: args[1].host_id,
}
_SUBMITTER_CALLS = ("submit_run", "cancel_run", "resume_run", "run_status", "runs_with_labels", "hold_run",
                    "release_run", "freeze_run", "thaw_run", "set_limit", "drop_limit", "list_limits",
                    "resume_with_dependants", "dependencies_of", "dependants_of")


# What ensure_login_role and bind_host_role made already: (cluster port, role) and (port, database, role).
_made: set[tuple] = set()


def bound_role_name(host_id: str) -> str:
    """The login role a test binds to host_id."""
    return "uvtest_host_" + re.sub(r"[^a-z0-9_]", "_", host_id.lower())


def ensure_login_role(postgres: Postgres, role: str, member_of: str) -> None:
    """A login role of the cluster (roles outlive the per-test databases), created once; without a
    password, since the throwaway cluster trusts 127.0.0.1."""
    if (postgres.port, role) in _made:
        return
    _made.add((postgres.port, role))
    with store.connect(postgres.dsn) as admin:
        try:
            admin.execute(sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(
                sql.Identifier(role), sql.Identifier(member_of)))
        except psycopg.errors.DuplicateObject:
            pass


def bind_host_role(conn: psycopg.Connection, postgres: Postgres, host_id: str) -> str:
    """A login role bound to host_id in conn's database (created when missing); returns its name. The
    binding commits at once, on a session of its own: inside the test's own transaction it would
    hold up another session's binding of the same host until that transaction ends."""
    role = bound_role_name(host_id)
    ensure_login_role(postgres, role, store.HOST_ROLE)
    if (postgres.port, conn.info.dbname, role) in _made:
        return role
    _made.add((postgres.port, conn.info.dbname, role))
    with store.connect(postgres.dsn_for(conn.info.dbname)) as binder:
        binder.execute("INSERT INTO unitvisor.host_roles (role_name, host_id) VALUES (%s, %s) ON CONFLICT DO NOTHING",
                       (role, host_id))
    return role


@contextlib.contextmanager
def session_as(conn: psycopg.Connection, role: str) -> Iterator[None]:
    """Run what is inside as `role` (a superuser's session only), then as the login role again. Inside a
    failed transaction nothing can run: its rollback undoes the SET as well."""
    conn.execute(sql.SQL("SET SESSION AUTHORIZATION {}").format(sql.Identifier(role)))
    try:
        yield
    finally:
        if conn.info.transaction_status != psycopg.pq.TransactionStatus.INERROR:
            conn.execute("RESET SESSION AUTHORIZATION")


@pytest.fixture(params=["superuser", "bound roles"])
def as_bound_roles(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, postgres: Postgres) -> str:
    if request.param == "superuser":
        return request.param
    switched: set[int] = set()  # connections inside a wrapped call: nested store calls stay as they are
    ensure_login_role(postgres, TEST_SUBMITTER, store.SUBMITTER_ROLE)

    def wrap(name: str, original: Callable[..., Any], role_for: Callable[[tuple], str]) -> Callable[..., Any]:
        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            conn = args[0]
            if id(conn) in switched:
                return original(*args, **kwargs)
            role = role_for(args)
            switched.add(id(conn))
            try:
                with session_as(conn, role):
                    return original(*args, **kwargs)
            finally:
                switched.discard(id(conn))
        return call

    for name, host_of in _HOST_CALLS.items():
        monkeypatch.setattr(store, name, wrap(name, getattr(store, name),
                                              lambda args, host_of=host_of: bind_host_role(args[0], postgres,
                                                                                           host_of(args))))
    for name in _SUBMITTER_CALLS:
        monkeypatch.setattr(store, name, wrap(name, getattr(store, name), lambda args: TEST_SUBMITTER))
    return request.param


@pytest.fixture
def spawn_listener(dsn: str) -> Iterator[psycopg.Connection]:
    """A session that listens on unitvisor_spawn, as a daemon does."""
    with store.connect(dsn) as conn:
        store.listen(conn, store.SPAWN_CHANNEL)
        yield conn


@contextlib.contextmanager
def fleet(dsn: str, conn: psycopg.Connection, count: int, **profile: object) -> Iterator[list[store.Fence]]:
    """`count` registered hosts h1..hN, each on a connection of its own (as daemons are)."""
    with contextlib.ExitStack() as stack:
        conns = [conn] + [stack.enter_context(store.connect(dsn)) for _ in range(count - 1)]
        yield [register(c, f"h{i}", **profile) for i, c in enumerate(conns, 1)]


def backend_gone(observer: psycopg.Connection, pid: int) -> None:
    """Wait until a closed connection's server process has ended and released its session locks (a
    host's lock among them): closing the client returns before the server has noticed."""
    deadline = time.monotonic() + 10
    while observer.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()[0]:
        assert time.monotonic() < deadline, f"backend {pid} did not end"
        time.sleep(0.01)

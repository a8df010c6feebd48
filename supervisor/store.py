"""The only module with SQL: connections, transactions, one function per query, and migrations.

Every statement is parameterised; no value is ever formatted into SQL text. Connections are in
autocommit mode, and whatever must happen together runs inside one explicit `conn.transaction()`.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import class_row, dict_row
from psycopg.types.json import Jsonb

from supervisor import river
from supervisor.model import Accounting, Attempt, OutcomeRecord, Pruned, Run, RunStatus
from supervisor.outcomes import Outcome

# Where the SQL is, first found wins: inside the package in an installed wheel (pyproject.toml maps the
# top-level sql/ to supervisor/sql), beside the package in a checkout and in the Debian package
# (/usr/share/unitvisor/sql, with the package in /usr/share/unitvisor/supervisor).
#
# The layout inside it, the one rule the loader knows:
#   sql/schema.sql             the whole current schema, the file a reader opens (and what `migrate`
#                              applies to an empty database, see migrate());
#   sql/migrations/NNN_*.sql   the history: every file there is a migration, applied in the order of
#                              its name (three or more digits, then lower-case words), each once.
# Nothing else in sql/ is read; a migration left at the top level of sql/ is an error (stray_migrations),
# so that one merged from an older branch cannot be skipped silently.
SQL_DIRS = (Path(__file__).resolve().parent / "sql", Path(__file__).resolve().parent.parent / "sql")
MIGRATIONS_SUBDIR = "migrations"
SCHEMA_FILE_NAME = "schema.sql"


def find_sql_dir(candidates: tuple[Path, ...] = SQL_DIRS) -> Path | None:
    """The first of the candidates whose migrations/ holds a .sql file, or None."""
    return next((d for d in candidates if any((d / MIGRATIONS_SUBDIR).glob("*.sql"))), None)


# Tests name files in them; None when this installation has no migrations (an error at migrate time).
SQL_ROOT = find_sql_dir()
MIGRATIONS_DIR = SQL_ROOT / MIGRATIONS_SUBDIR if SQL_ROOT is not None else None
SCHEMA_FILE = SQL_ROOT / SCHEMA_FILE_NAME if SQL_ROOT is not None else None
# The directory of the migrations under the name it had when they lay in sql/ itself: tests written
# before the move (store.SQL_DIR / "001_schema.sql") keep finding them.
SQL_DIR = MIGRATIONS_DIR
_MIGRATION_RE = re.compile(r"^(\d{3,})_[a-z0-9_]+\.sql\Z")
# pg_advisory_lock key for migrations: the bytes of "unitvisr" as a bigint, so that two hosts that
# migrate at once run one after the other.
MIGRATION_LOCK_KEY = int.from_bytes(b"unitvisr", "big") & 0x7FFF_FFFF_FFFF_FFFF
# The migration that creates the three roles (sql/migrations/004_roles.sql): those after it run as the admin.
ROLES_MIGRATION = 4
ADMIN_ROLE = "unitvisor_admin"
SUBMITTER_ROLE = "unitvisor_submitter"
HOST_ROLE = "unitvisor_host"
# The River source's functions (schema 034): granted to the login roles of River hosts only, besides HOST_ROLE.
RIVER_ROLE = "unitvisor_river"
SPAWN_CHANNEL = "unitvisor_spawn"
CANCEL_CHANNEL = "unitvisor_cancel"
# The payload that says, on a host's own channel (schema 048), that a cancel or a freeze request waits
# for one of its runs; any other payload there is a job that names this host alone.
OWN_CHANNEL_REQUEST = "cancel"


def spawn_hint_targets(payload: str) -> frozenset[str] | None:
    """The hosts a notification on SPAWN_CHANNEL asks to claim (sql/migrations/010_wake_targets.sql:
    {"hosts": [...]}), or None for every host: the empty payload (as before 010), and one this release
    cannot read, which costs a claim that finds nothing at worst, where ignoring it could leave a run to
    the next poll."""
    try:
        hosts = json.loads(payload)["hosts"] if payload else None
    except (ValueError, TypeError, KeyError):
        return None
    if not isinstance(hosts, list) or not all(isinstance(h, str) for h in hosts):
        return None
    return frozenset(hosts)

Connection = psycopg.Connection


class DatabaseError(Exception):
    """A database problem, in one line fit for an operator."""


class DatabaseUnavailable(DatabaseError):
    """The database cannot be reached (names host and port, never the password)."""


class Fenced(DatabaseError):
    """This host's epoch is over: it was declared dead, or its id was taken over, or its row is gone.
    Nothing it writes is accepted until it registers again."""


FENCED_SQLSTATE = "UV001"


@dataclass(frozen=True)
class Fence:
    """What every write of a host carries: its id and the epoch it registered with. The database
    refuses a write whose epoch is no longer the host's (unitvisor.check_fence)."""

    host_id: str
    epoch: int


@contextmanager
def _fencing() -> Iterator[None]:
    try:
        yield
    except psycopg.Error as exc:
        if exc.sqlstate == FENCED_SQLSTATE:
            raise Fenced(one_line(exc.diag.message_primary or str(exc))) from None
        raise


# What a broken or unreachable database raises mid-work: the caller drops the connection and
# reconnects, rather than blaming the row at hand.
CONNECTION_LOST = (DatabaseUnavailable, psycopg.OperationalError, psycopg.InterfaceError)


def dsn_location(dsn: str) -> str:
    """host:port of a DSN, for messages. Never includes the user or the password."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "<unparsable DSN>"
    host = params.get("host") or os.environ.get("PGHOST") or "localhost"
    port = params.get("port") or os.environ.get("PGPORT") or "5432"
    return f"{host}:{port}"


def one_line(exc: BaseException) -> str:
    """An exception as one line for an operator (psycopg's messages span several)."""
    return " ".join(str(exc).split()) or type(exc).__name__


# Client-side TCP keepalives: a peer that vanished (a host powered off, a NAT that forgot the
# connection) is noticed in about 20 s instead of the kernel's two hours. Chosen, not inherited.
_KEEPALIVES = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 2}
# Server-side limits for every session of ours: a row lock held by someone else, a statement stuck,
# or a transaction left open cannot block a daemon for longer than these; the statement fails with a
# clear error, and the daemon backs off and goes on.
# jit off, where PostgreSQL's default is on above jit_above_cost: every statement of ours touches a few
# rows, but a planner's estimate over a deep queue can pass the threshold, and then a backend loads LLVM
# (about 100 MB of library to map and relocate, once per session) and compiles the statement's
# expressions, tens of milliseconds of CPU that no short statement pays back. In bench.scale's burst of
# 10,000 runs on 300 hosts (issue 23) JIT was a fifth of the server's CPU; off, the burst cost 43.6 s of
# server CPU instead of 58.3 s. Chosen, not inherited: a control plane's own sessions keep the server's.
SESSION_SETTINGS = {"lock_timeout": "5s", "statement_timeout": "15s", "idle_in_transaction_session_timeout": "30s",
                    "jit": "off"}


# How a DSN is written, for the errors about one that cannot be read: both forms libpq takes.
DSN_EXAMPLES = ("postgresql://unitvisor:PASSWORD@db.example.com:5432/unitvisor, or "
                "host=db.example.com port=5432 user=unitvisor password=PASSWORD dbname=unitvisor")
_URI_PREFIXES = ("postgresql://", "postgres://")


def parse_dsn(dsn: str) -> dict[str, str]:
    """The DSN's parameters, or a DatabaseError that shows how to write one. libpq's own message is
    left out: it quotes the text around the mistake, which may be a piece of the password.

    A URI whose password holds '@' or '/' parses, but wrongly: `postgresql://u:p@ss@db/x` as the host
    `ss@db`, `postgresql://u:p/ss@db/x` as the host `u` and the port `p`; the connection then fails
    with "cannot connect to the database at ss@db:5432", which says nothing of the cause."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        raise DatabaseError(f"the database DSN cannot be parsed: write it as {DSN_EXAMPLES}") from None
    if dsn.lstrip().startswith(_URI_PREFIXES):
        hosts = (params.get("host") or "").split(",")
        ports = (params.get("port") or "").split(",")
        # A host never holds '@' (a socket directory begins with '/': ?host=/var/run/postgresql); a
        # password's '/' ends the authority early, leaving a port that is no number, or the rest of it,
        # '@' and all, as the database's name.
        if (any("@" in h for h in hosts) or not all(p.isdigit() or not p for p in ports)
                or "@" in (params.get("dbname") or "")):
            raise DatabaseError(
                "the database DSN (a URI) cannot be read: a password with '@', '/' or '#' must be "
                "percent-encoded there (@ as %40, / as %2F, # as %23: postgresql://unitvisor:PASS%40WORD@db.example.com"
                "/unitvisor), or use the key=value form, which takes it as it is in single quotes "
                "(host=db.example.com user=unitvisor password='PASS@WORD' dbname=unitvisor)")
    return params


def connect(dsn: str, connection_class: type[Connection] = psycopg.Connection) -> Connection:
    params = parse_dsn(dsn)
    extra: dict[str, Any] = {key: value for key, value in _KEEPALIVES.items() if key not in params}
    if "connect_timeout" not in params:
        extra["connect_timeout"] = 5
    try:
        conn = connection_class.connect(dsn, autocommit=True, application_name="unitvisor", **extra)
    except psycopg.Error as exc:
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise DatabaseUnavailable(f"cannot connect to the database at {dsn_location(dsn)}: {reason}") from None
    try:
        conn.execute("SELECT " + ", ".join(f"set_config('{name}', %s, false)" for name in SESSION_SETTINGS),
                     list(SESSION_SETTINGS.values()))
    except psycopg.Error as exc:
        conn.close()
        raise DatabaseUnavailable(f"the database at {dsn_location(dsn)} refused the session settings: "
                                  f"{one_line(exc)}") from None
    return conn


def set_idle_session_timeout(conn: Connection, seconds: float) -> None:
    """End this session on the server once its client has said nothing for this long (PostgreSQL 14
    and newer; older servers keep it): a daemon cut off behind a black hole leaves no session that
    holds its host lock for ever."""
    conn.execute("SELECT set_config('idle_session_timeout', %s, false) "
                 "WHERE current_setting('server_version_num')::int >= 140000", (f"{int(seconds * 1000)}ms",))


# -- migrations ---------------------------------------------------------------------------------
#
# The rule for every migration in sql/migrations/ (a rolling upgrade runs old and new daemons side by side on
# one schema, host by host; README "Upgrades"):
#
# 1. Expand, then contract. A migration only adds: tables, columns with defaults (or nullable),
#    functions under new names, constraints that old rows and old daemons' writes satisfy. The daemon
#    of the previous version must keep working against it, so `unitvisor migrate` can run first.
# 2. Nothing the previous version reads or writes changes shape or meaning in the same release.
#    Renames and removals (the contract) come one release later, once no daemon of the old version
#    can be running; the release notes say so.
# 3. Daemons read rows by explicit column lists (never SELECT *), so columns they do not know (a
#    later migration's, or a control plane's own) are invisible to them.
# 4. A daemon refuses to work only while a migration it needs is missing, and says which; migrations
#    it does not know (a newer schema) are fine.
# 5. Big tables stay writable. A CHECK or foreign key on runs, attempts, spawn_jobs or run_events is
#    added NOT VALID: the runner validates it after the migration's commit (_validate_constraints),
#    with writes going on, where a validating ADD CONSTRAINT would scan the table under ACCESS
#    EXCLUSIVE. An index on a column that exists already is created IF NOT EXISTS, and README's
#    Upgrade section gives the CREATE INDEX CONCURRENTLY an operator runs first on a big database.


def migration_files(migrations_dir: Path | None = None) -> list[tuple[str, Path]]:
    """The migrations in order, from migrations_dir or else the migrations/ of the first of SQL_DIRS
    that has any. None found is an error: an installation without its migrations must never report
    the schema as current."""
    if migrations_dir is not None:
        found: Path | None = migrations_dir if any(migrations_dir.glob("*.sql")) else None
        where: tuple[Path, ...] = (migrations_dir,)
    else:
        root = find_sql_dir(SQL_DIRS)
        found = root / MIGRATIONS_SUBDIR if root is not None else None
        where = tuple(d / MIGRATIONS_SUBDIR for d in SQL_DIRS)
    if found is None:
        raise DatabaseError(f"no migration files (NNN_name.sql) in {' or '.join(map(str, where))}: "
                            "this installation of unitvisor is incomplete")
    files = []
    for path in sorted(found.glob("*.sql")):
        match = _MIGRATION_RE.match(path.name)
        if not match:
            raise DatabaseError(f"{path}: migration files are named NNN_name.sql")
        files.append((path.stem, path))
    return files


def stray_migrations(sql_root: Path) -> list[Path]:
    """Migration files at the top level of sql/ instead of in sql/migrations/: one written on a branch
    from before the move. The loader never reads them; the unit tests refuse them."""
    return sorted(p for p in sql_root.glob("*.sql") if _MIGRATION_RE.match(p.name))


def _migration_number(version: str) -> int:
    return int(version.split("_", 1)[0])


def applied_migrations(conn: Connection) -> set[str]:
    exists = conn.execute("SELECT to_regclass('unitvisor.schema_migrations') IS NOT NULL").fetchone()[0]
    if not exists:
        return set()
    return {row[0] for row in conn.execute("SELECT version FROM unitvisor.schema_migrations")}


def pending_migrations(conn: Connection, migrations_dir: Path | None = None) -> list[str]:
    files = migration_files(migrations_dir)  # first: none found is an error, whatever the database holds
    done = applied_migrations(conn)
    return [version for version, _ in files if version not in done]


# What `unitvisor migrate` changes in its own session while it runs (restored afterwards; the daemons'
# sessions keep SESSION_SETTINGS). A migration may scan a big table (VALIDATE CONSTRAINT, CREATE INDEX:
# about 10 s per million runs), and under the daemons' 15 s statement_timeout it failed every time on a
# database of 1.5 million runs, with no way for the operator to lift it. lock_timeout is kept: a
# statement that waits for a table lock queues every reader and writer of that table behind it, so it
# must not wait long; the migration is rolled back and tried again instead (MIGRATION_LOCK_TRIES).
# Only the wait for another migrate (the advisory lock) is unbounded, see _migration_lock.
MIGRATION_SESSION_SETTINGS = {"statement_timeout": "0"}
# How often a migration (or a validation) that timed out on a table lock is tried, and the pause before
# the next try, growing with each: about half a minute in all with the 5 s lock_timeout.
MIGRATION_LOCK_TRIES = 4
MIGRATION_RETRY_PAUSE = 1.0


def _set_session(conn: Connection, settings: dict[str, str]) -> None:
    conn.execute("SELECT " + ", ".join("set_config(%s, %s, false)" for _ in settings),
                 [item for pair in settings.items() for item in pair])


@contextmanager
def _session_settings(conn: Connection, settings: dict[str, str]) -> Iterator[None]:
    """These settings for this session while the block runs, then the session's own again."""
    names = list(settings)
    before = conn.execute("SELECT " + ", ".join("current_setting(%s)" for _ in names), names).fetchone()
    _set_session(conn, settings)
    try:
        yield
    finally:
        if not conn.broken:  # a lost connection took its settings with it
            _set_session(conn, dict(zip(names, before, strict=True)))


def _migration_lock_holder(conn: Connection) -> int | None:
    """The server pid of the session that holds the migration lock, if any (an advisory lock on a bigint
    key is classid = its high 32 bits, objid = its low 32 bits, objsubid = 1)."""
    row = conn.execute("SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1 "
                       "AND classid::bigint = %s AND objid::bigint = %s",
                       (MIGRATION_LOCK_KEY >> 32, MIGRATION_LOCK_KEY & 0xFFFF_FFFF)).fetchone()
    return row[0] if row else None


@contextmanager
def _migration_lock(conn: Connection, on_wait: Callable[[str], None] | None) -> Iterator[None]:
    """Hold the migration lock for the block: a second migrate waits for the first, however long that
    one takes, then finds nothing left to do. Without lifting lock_timeout here, the second failed
    after the daemons' 5 s while the first validated a big table."""
    if not conn.execute("SELECT pg_try_advisory_lock(%s)", (MIGRATION_LOCK_KEY,)).fetchone()[0]:
        if on_wait is not None:
            holder = _migration_lock_holder(conn)
            on_wait(f"another migrate is running (server pid {holder if holder is not None else 'unknown'}): "
                    "waiting for it to end")
        with _session_settings(conn, {"lock_timeout": "0"}):
            conn.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK_KEY,))
    try:
        yield
    finally:
        if not conn.broken:  # a lost connection released it
            conn.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK_KEY,))


def _retrying_lock_timeouts(what: str, work: Callable[[], None]) -> None:
    """work() (one transaction), tried again after a pause when it timed out waiting for a table lock
    that another session holds, or was chosen to end a deadlock with one (a migration locks several
    tables, a daemon's statement takes some of them in another order; either is rolled back whole);
    a DatabaseError naming `what` once MIGRATION_LOCK_TRIES are spent."""
    for attempt in range(1, MIGRATION_LOCK_TRIES + 1):
        try:
            work()
            return
        except (psycopg.errors.LockNotAvailable, psycopg.errors.DeadlockDetected) as exc:
            if attempt == MIGRATION_LOCK_TRIES:
                raise DatabaseError(
                    f"{what}: a table lock was not granted within lock_timeout, {attempt} times "
                    f"({one_line(exc)}): another session holds it (see pg_locks and pg_stat_activity); "
                    "nothing of it was applied, run `unitvisor migrate` again") from None
            time.sleep(MIGRATION_RETRY_PAUSE * attempt)


def _apply_migration(conn: Connection, version: str, path: Path) -> None:
    with conn.transaction():
        if _migration_number(version) > ROLES_MIGRATION:
            # What a later migration creates must be the admin's, not the login role's that
            # happens to migrate (sql/migrations/004_roles.sql); SET LOCAL ends with the transaction.
            conn.execute(sql.SQL("SET LOCAL ROLE {}").format(sql.Identifier(ADMIN_ROLE)))
        conn.execute(path.read_text())
        conn.execute("INSERT INTO unitvisor.schema_migrations (version) VALUES (%s)", (version,))


def unvalidated_constraints(conn: Connection) -> list[tuple[str, str, str]]:
    """(table, constraint, table owner) of every CHECK and foreign key on unitvisor's tables that is
    still NOT VALID."""
    return [tuple(row) for row in conn.execute(
        "SELECT t.relname::text, c.conname::text, pg_get_userbyid(t.relowner)::text "
        "FROM pg_constraint c JOIN pg_class t ON t.oid = c.conrelid "
        "WHERE t.relnamespace = 'unitvisor'::regnamespace AND NOT c.convalidated AND c.contype IN ('c', 'f') "
        "ORDER BY 1, 2")]


def _validate_constraints(conn: Connection) -> None:
    """VALIDATE every constraint that a migration added NOT VALID, each in its own transaction.

    A migration adds a CHECK or a foreign key to a table that may be big NOT VALID, in its own
    transaction: taking ACCESS EXCLUSIVE for a moment, and enforcing it on every row written from then
    on. The scan of the rows already there runs here, after that transaction committed, under SHARE
    UPDATE EXCLUSIVE, which lets the daemons read and write the table meanwhile (a scan inside the
    migration's transaction would hold its ACCESS EXCLUSIVE lock throughout: writes to runs stopped for
    10 s per million runs). Every migrate validates whatever is still NOT VALID, so a validation cut
    short (a crash, Ctrl-C, a row that fails it) is finished by the next migrate. Rule 1 above (a
    constraint that old rows satisfy) is what lets it succeed."""
    for table, constraint, owner in unvalidated_constraints(conn):
        def validate(table: str = table, constraint: str = constraint, owner: str = owner) -> None:
            with conn.transaction():
                # ALTER TABLE needs the table's owner (unitvisor_admin from 004 on), of which the role
                # that migrates is a member.
                conn.execute(sql.SQL("SET LOCAL ROLE {}").format(sql.Identifier(owner)))
                conn.execute(sql.SQL("ALTER TABLE {} VALIDATE CONSTRAINT {}").format(
                    sql.Identifier("unitvisor", table), sql.Identifier(constraint)))
        try:
            _retrying_lock_timeouts(f"validating constraint {constraint} of unitvisor.{table}", validate)
        except (psycopg.errors.CheckViolation, psycopg.errors.ForeignKeyViolation) as exc:
            raise DatabaseError(
                f"constraint {constraint} of unitvisor.{table}: a row written before it was added violates "
                f"it ({one_line(exc)}); it is enforced on new rows already; correct or delete the row, then "
                "run `unitvisor migrate` again to validate it") from None


# A new database is made from sql/schema.sql, not by replaying the history (decided for issue 24, as
# procrastinate does): `migrate` on a database that has no migration recorded applies schema.sql in one
# transaction, which records the migrations it holds (its last statement); those after them, if any, are
# then applied as on any database. Why:
# - the file a reader opens is the file that made the database: what they read is what runs;
# - one transaction of final definitions, where the history creates, drops and re-creates functions in
#   a transaction per migration (and validates constraints after each): a new database's `migrate` is quicker;
# - the history is not left untested by it: every upgrade applies migrations, and
#   tests/integration/test_schema_file.py builds a database by every migration and one from schema.sql
#   and fails, saying what differs, unless their catalogs are the same.
# What would break: a schema.sql that lags its migrations makes new databases differ from upgraded
# ones (that test catches it before a release), and one that records a migration it does not hold
# would skip it (it records its list in the same file, beside the change, and the same test checks both).
# The history alone still makes a database: migrate(..., from_schema=False), or a migrations directory
# with no schema.sql beside it.


def schema_file_beside(migrations_dir: Path) -> Path | None:
    """sql/schema.sql for sql/migrations/: the directory's sibling, when the directory is named
    migrations/ and the file exists; None for any other directory (a test's partial history)."""
    candidate = migrations_dir.parent / SCHEMA_FILE_NAME
    return candidate if migrations_dir.name == MIGRATIONS_SUBDIR and candidate.is_file() else None


def _apply_schema_file(conn: Connection, schema_file: Path, versions: list[str]) -> list[str]:
    """Apply schema.sql in one transaction; the migrations it records as held, in order. Refused (and
    rolled back) when it records one that is not among `versions`: an installation whose schema.sql is
    newer than its migrations is broken, and must not mark a migration applied that the next release
    would then skip."""
    recorded: list[str] = []

    def work() -> None:
        with conn.transaction():
            # schema.sql creates the roles, then SET LOCAL ROLE unitvisor_admin itself, as 004 does.
            conn.execute(schema_file.read_text())
            recorded[:] = [row[0] for row in conn.execute(
                "SELECT version FROM unitvisor.schema_migrations ORDER BY version")]
            unknown = sorted(set(recorded) - set(versions))
            if unknown:
                raise DatabaseError(f"{schema_file} records migration(s) {', '.join(unknown)}, which are not "
                                    f"among the migrations beside it: this installation of unitvisor is incomplete")

    _retrying_lock_timeouts(f"the schema in {schema_file}", work)
    return recorded


def migrate(conn: Connection, migrations_dir: Path | None = None,
            on_wait: Callable[[str], None] | None = None, from_schema: bool = True) -> list[str]:
    """Bring the database up to the last migration, and return what that applied: on a database with no
    migration recorded, schema.sql beside the migrations (when there is one and from_schema) and the
    migrations after those it holds; on any other, the missing migrations in order, each in its own
    transaction, then validate what each added NOT VALID. Waits for a migrate of another session (on_wait
    is told why)."""
    files = migration_files(migrations_dir)
    schema_file = schema_file_beside(files[0][1].parent) if from_schema else None
    with _session_settings(conn, MIGRATION_SESSION_SETTINGS), _migration_lock(conn, on_wait):
        with conn.transaction():
            conn.execute("CREATE SCHEMA IF NOT EXISTS unitvisor")
            conn.execute("""CREATE TABLE IF NOT EXISTS unitvisor.schema_migrations (
                                version text PRIMARY KEY,
                                applied_at timestamptz NOT NULL DEFAULT now())""")
        _validate_constraints(conn)  # those an interrupted migrate left
        done = applied_migrations(conn)
        applied = []
        if not done and schema_file is not None:
            applied = _apply_schema_file(conn, schema_file, [version for version, _ in files])
            done = set(applied)
        for version, path in files:
            if version in done:
                continue
            _retrying_lock_timeouts(f"migration {version}", lambda v=version, p=path: _apply_migration(conn, v, p))
            applied.append(version)
            _validate_constraints(conn)
        return applied


# -- runs ---------------------------------------------------------------------------------------

# Rows are read by explicit column lists, never `SELECT *`: a column added by a later migration or by
# a control plane must not break a daemon that does not know it.
_RUN_FIELDS = [f.name for f in fields(Run)]
_ATTEMPT_FIELDS = [f.name for f in fields(Attempt)]
# wait_reason is not a column of runs (0.1.0's SELECT * would break on it: sql/migrations/002_fleet.sql); the
# function that run_status reads it with too (sql/migrations/006_lifecycle.sql), so that the two agree.
_RUN_COLUMN_SQL = {"wait_reason": "unitvisor.wait_reason(r) AS wait_reason",
                   # Counted, not kept: record_outcome, the one writer of outcomes, counts the same way.
                   "lost_attempts": "(SELECT count(*)::integer FROM unitvisor.attempts l "
                                    "WHERE l.run_id = r.id AND l.outcome = 'lost') AS lost_attempts"}
_RUN_COLUMNS = ", ".join(_RUN_COLUMN_SQL.get(name, f"r.{name}") for name in _RUN_FIELDS)
# The daemon's reads of runs (claim, open_attempts) without wait_reason: a run it claims or holds an open
# attempt of is not waiting, and the function, a SQL one with a SET clause, is planned at every call
# (never inlined): 0.4 ms of each claim of one run, on every run's path to its start (issue 27).
_DAEMON_RUN_COLUMNS = ", ".join({**_RUN_COLUMN_SQL, "wait_reason": "NULL::text AS wait_reason"}.get(name, f"r.{name}")
                                for name in _RUN_FIELDS)
_ATTEMPT_COLUMNS = ", ".join(f"a.{name}" for name in _ATTEMPT_FIELDS)

# submit_run's arguments and their SQL types: each value is cast, so that a number too large for
# its column is an out-of-range error, not "no function submit_run(numeric, ...)".
_SUBMIT_ARGS = {
    "argv": "text[]", "environment": "jsonb", "working_directory": "text", "run_user": "text",
    "memory_max": "bigint", "cpu_quota_percent": "integer", "tasks_max": "integer", "io_weight": "integer",
    "runtime_max_sec": "bigint", "max_attempts": "integer", "host_pin": "text", "priority": "integer",
    "private_network": "boolean", "idempotency_key": "text", "labels": "jsonb",
    "concurrency_key": "text", "not_before": "timestamptz", "start_deadline": "timestamptz",
    "memory_high": "bigint",  # schema 017
    # Graceful stop (schema 026): signal names, seconds.
    "stop_signal": "text", "stop_timeout": "integer", "warn_before": "integer", "warn_signal": "text",
    # Failure rules (schema 027); retry_on's and the backoffs were settable only through SQL until then.
    "retry_on": "text[]", "retry_backoff_sec": "integer", "retry_backoff_max_sec": "integer",
    "fail_on": "text[]", "count_lost": "boolean", "max_lost_attempts": "integer",
    # schema 030: submitted held (never claimed until released)
    "hold": "boolean",
    # schema 032: how many runs of its concurrency_key may be live at once (1: one at a time)
    "concurrency_limit": "integer",
    # schema 033: placement (labels every host that runs it must have; a retry's preference for another host)
    "host_labels": "jsonb", "avoid_failed_host": "boolean",
    # schema 035: the runs it runs after, and what it needs of them ('succeeded' or 'finished')
    "after": "uuid[]", "after_policy": "text",
}
_JSON_ARGS = ("environment", "labels", "host_labels")


def submit_run(conn: Connection, **values: Any) -> uuid.UUID:
    """Create a run and its spawn job in one transaction, through the SQL function control planes use."""
    unknown = set(values) - set(_SUBMIT_ARGS)
    if unknown:
        raise TypeError(f"unknown run fields: {sorted(unknown)}")
    names = [name for name in _SUBMIT_ARGS if values.get(name) is not None]
    params = [Jsonb(values[n]) if n in _JSON_ARGS else values[n] for n in names]
    # Named-argument notation; the names come from the fixed tuple above, never from input.
    call = sql.SQL("SELECT unitvisor.submit_run({})").format(sql.SQL(", ").join(
        sql.SQL("{} => %s::{}").format(sql.Identifier(name), sql.SQL(_SUBMIT_ARGS[name])) for name in names))
    try:
        return conn.execute(call, params).fetchone()[0]
    except psycopg.errors.CheckViolation as exc:
        # submit_run's message names the argument and what is allowed, and holds no value of the
        # environment (sql/migrations/005_sql_api.sql); the constraint's name is what a script may match on.
        message = exc.diag.message_primary or ""
        constraint = exc.diag.constraint_name
        raise DatabaseError(f"the database refused the run: {message} ({constraint})" if message and constraint
                            else f"the database refused the run: {constraint or message}") from None
    except psycopg.errors.InvalidParameterValue as exc:
        # An argument over its size bound (unitvisor.check_run_sizes, sql/migrations/015): the primary message names
        # it, its size and the limit; the rest (PL/pgSQL's CONTEXT) says nothing to an operator.
        raise DatabaseError(f"the database refused the run: {exc.diag.message_primary or one_line(exc)}") from None
    except psycopg.DataError as exc:
        raise DatabaseError(f"the database refused the run: {one_line(exc)}") from None


def get_run(conn: Connection, run_id: uuid.UUID) -> Run | None:
    with conn.cursor(row_factory=class_row(Run)) as cur:
        return cur.execute(f"SELECT {_RUN_COLUMNS} FROM unitvisor.runs r WHERE r.id = %s", (run_id,)).fetchone()


# In the order unitvisor.run_status returns them (sql/migrations/005_sql_api.sql), named, never `*`.
_RUN_STATUS_COLUMNS = ", ".join(f.name for f in fields(RunStatus))


def run_status(conn: Connection, run_id: uuid.UUID) -> RunStatus | None:
    """A run's status through the function control planes call, so that the CLI and they cannot
    disagree on it. None: no such run."""
    with conn.cursor(row_factory=class_row(RunStatus)) as cur:
        return cur.execute(f"SELECT {_RUN_STATUS_COLUMNS} FROM unitvisor.run_status(%s)", (run_id,)).fetchone()


def runs_with_labels(conn: Connection, labels: dict[str, str], max_rows: int = 100) -> list[RunStatus]:
    """The status of every run carrying all of `labels`, newest first (unitvisor.runs_with_labels)."""
    with conn.cursor(row_factory=class_row(RunStatus)) as cur:
        return cur.execute(f"SELECT {_RUN_STATUS_COLUMNS} FROM unitvisor.runs_with_labels(%s, %s)",
                           (Jsonb(labels), max_rows)).fetchall()


def find_run_ids(conn: Connection, prefix: str, limit: int = 10) -> list[uuid.UUID]:
    """Run ids starting with a (validated, lowercase hex) prefix."""
    rows = conn.execute(
        "SELECT id FROM unitvisor.runs WHERE id::text LIKE %s ORDER BY id LIMIT %s",
        (prefix.replace("%", "").replace("_", "") + "%", limit),
    ).fetchall()
    return [row[0] for row in rows]


def get_attempts(conn: Connection, run_id: uuid.UUID) -> list[Attempt]:
    with conn.cursor(row_factory=class_row(Attempt)) as cur:
        return cur.execute(
            f"SELECT {_ATTEMPT_COLUMNS} FROM unitvisor.attempts a WHERE a.run_id = %s ORDER BY a.attempt",
            (run_id,)).fetchall()


def get_outcome_records(conn: Connection, run_id: uuid.UUID) -> dict[int, OutcomeRecord]:
    """What each ended attempt of a run keeps besides its outcome (schema 007), by attempt number.
    Read apart from get_attempts, so that the daemon's reads of open attempts never carry the tails."""
    rows = conn.execute(
        """SELECT a.attempt, a.cpu_usage_nsec, a.memory_peak_bytes, a.io_read_bytes, a.io_write_bytes, a.tasks_peak,
                  a.output_tail
           FROM unitvisor.attempts a WHERE a.run_id = %s AND a.outcome IS NOT NULL ORDER BY a.attempt""",
        (run_id,)).fetchall()
    return {row[0]: OutcomeRecord(row[0], Accounting(*row[1:6]), row[6]) for row in rows}


def next_attempt_at(conn: Connection, run_id: uuid.UUID) -> datetime | None:
    """When a queued run's next attempt is due while it waits out its retry backoff (None: not waiting
    for one, or a run this role may not see). Through unitvisor.next_attempt_at (sql/021_operator.sql):
    the due time is the spawn job's, which a host role may not read."""
    return conn.execute("SELECT unitvisor.next_attempt_at(%s)", (run_id,)).fetchone()[0]


def get_events(conn: Connection, run_id: uuid.UUID, limit: int = 20) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(
            """SELECT at, attempt, host_id, state, reason FROM unitvisor.run_events
               WHERE run_id = %s ORDER BY id DESC LIMIT %s""", (run_id, limit)).fetchall()
    return list(reversed(rows))


def list_runs(conn: Connection, states: Sequence[str] = (), host: str | None = None,
              since: timedelta | None = None, limit: int = 50,
              labels: dict[str, str] | None = None, held: bool = False,
              after: uuid.UUID | None = None) -> list[dict[str, Any]]:
    """Runs, newest first; with `held`, only held runs (schema 030); with `after`, only the runs that
    run after that one (name it in their after, schema 035); with `labels`, only runs that carry
    every one of them (the @> of unitvisor.runs_with_labels, on the same GIN index). The status columns
    (state, the latest attempt's host, number, outcome and exit status) are unitvisor.run_status's, read
    for the rows listed only, so that `runs` says what a control plane reads: an expired run's outcome
    is `expired`, say."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(
            """SELECT q.id, s.state, q.argv, q.created_at, q.finished_at, q.labels, q.concurrency_key, q.not_before,
                      q.start_deadline, s.host_id, s.attempt, q.started_at, q.ended_at, s.outcome, s.exit_status,
                      s.wait_reason, q.held_at
               FROM (SELECT r.id, r.argv, r.created_at, r.finished_at, r.labels, r.concurrency_key, r.not_before,
                            r.start_deadline, a.started_at, a.ended_at, r.seq,
                            CASE WHEN r.state = 'queued' THEN r.held_at END AS held_at
                     FROM unitvisor.runs r
                     LEFT JOIN LATERAL (SELECT x.host_id, x.started_at, x.ended_at FROM unitvisor.attempts x
                                        WHERE x.run_id = r.id ORDER BY x.attempt DESC LIMIT 1) a ON true
                     WHERE (cardinality(%(states)s::text[]) = 0 OR r.state = ANY(%(states)s::text[]))
                       AND (%(host)s::text IS NULL OR a.host_id = %(host)s::text)
                       AND (%(since)s::interval IS NULL OR r.created_at >= now() - %(since)s::interval)
                       AND r.labels @> %(labels)s::jsonb
                       AND (NOT %(held)s OR (r.state = 'queued' AND r.held_at IS NOT NULL))
                       AND (%(after)s::uuid IS NULL OR EXISTS (
                            SELECT 1 FROM unitvisor.run_dependencies d
                            WHERE d.run_id = r.id AND d.after_id = %(after)s::uuid))
                     ORDER BY r.created_at DESC, r.seq DESC NULLS LAST, r.id LIMIT %(limit)s) q
               CROSS JOIN LATERAL unitvisor.run_status(q.id) s
               ORDER BY q.created_at DESC, q.seq DESC NULLS LAST, q.id""",
            {"states": list(states), "host": host, "since": since, "limit": limit, "labels": Jsonb(labels or {}),
             "held": held, "after": after},
        ).fetchall()


def record_event(conn: Connection, fence: Fence, attempt: Attempt, state: str, reason: str) -> None:
    """An event about an attempt that changes no state (a stop on its way, say), written by `fence`'s host."""
    with _fencing():
        conn.execute("SELECT unitvisor.record_event(%s, %s, %s, %s, %s, %s)",
                     (attempt.run_id, attempt.attempt, fence.host_id, fence.epoch, state, reason))


def mark_warned(conn: Connection, fence: Fence, attempt: Attempt, reason: str) -> bool:
    """The run's warn_signal was sent to the attempt's unit (schema 026): recorded on the attempt, with an
    event, once. False: it was recorded before, or the attempt is not open on this host."""
    with _fencing():
        return conn.execute("SELECT unitvisor.mark_warned(%s, %s, %s, %s, %s)",
                            (attempt.run_id, attempt.attempt, fence.host_id, fence.epoch, reason)).fetchone()[0]


@dataclass(frozen=True)
class Transition:
    """What an operator's request did: the run's state after it (None: no such run), and whether
    anything changed."""

    state: str | None
    changed: bool


def cancel_run(conn: Connection, run_id: uuid.UUID) -> Transition:
    """Ask for a run to be cancelled (unitvisor.cancel_run, which control planes call too). A queued
    run is cancelled at once (its job removed); a starting or running one is marked, and the owning
    daemon stops its unit."""
    row = conn.execute("SELECT state, changed FROM unitvisor.cancel_run(%s)", (run_id,)).fetchone()
    return Transition(row[0], row[1])


def resume_run(conn: Connection, run_id: uuid.UUID) -> Transition:
    """Reopen a failed or cancelled run (unitvisor.resume_run, which control planes call too): back
    to queued with a new spawn job, in one transaction. The next attempt is numbered after the last,
    and runs with the command and limits the row has now. Refused (changed=False) for a run that is
    queued, starting, running or succeeded."""
    row = conn.execute("SELECT state, changed FROM unitvisor.resume_run(%s)", (run_id,)).fetchone()
    return Transition(row[0], row[1])


def resume_with_dependants(conn: Connection, run_id: uuid.UUID) -> tuple[Transition, int]:
    """resume_run, and every run skipped below this one reopened too, waiting for it again
    (unitvisor.resume_run(run, with_dependants => true), schema 035). Returns the run's transition and
    how many dependants were reopened."""
    row = conn.execute("SELECT state, changed, dependants FROM unitvisor.resume_run(%s, true)", (run_id,)).fetchone()
    return Transition(row[0], row[1]), row[2]


# -- dependencies (schema 035) ------------------------------------------------------------------


def dependencies_of(conn: Connection, run_id: uuid.UUID) -> tuple[str | None, list[dict[str, Any]]]:
    """What a run needs of the runs it runs after ('succeeded' or 'finished'; None: it names none),
    and those runs, oldest first: id, state, and whether their state is what it needs (met: True),
    can no longer be (False), or they have not ended (None)."""
    policy = conn.execute("SELECT after_policy FROM unitvisor.runs WHERE id = %s", (run_id,)).fetchone()
    if policy is None or policy[0] is None:
        return None, []
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(
            """SELECT p.id, p.state,
                      CASE WHEN p.state = ANY (unitvisor.retention_states())
                           THEN unitvisor.dependency_met(%(policy)s, p.state) END AS met
               FROM unitvisor.run_dependencies d JOIN unitvisor.runs p ON p.id = d.after_id
               WHERE d.run_id = %(run)s ORDER BY p.created_at, p.seq NULLS FIRST, p.id""",
            {"run": run_id, "policy": policy[0]}).fetchall()
    return policy[0], rows


def dependants_of(conn: Connection, run_id: uuid.UUID) -> list[uuid.UUID]:
    """The runs that run after this one (name it in their after), oldest first."""
    rows = conn.execute(
        """SELECT c.id FROM unitvisor.run_dependencies d JOIN unitvisor.runs c ON c.id = d.run_id
           WHERE d.after_id = %s ORDER BY c.created_at, c.seq NULLS FIRST, c.id""", (run_id,)).fetchall()
    return [row[0] for row in rows]


# -- hold and freeze (schema 030) ---------------------------------------------------------------


class Refused(DatabaseError):
    """The database refused an operator's request on a run in the state it is in (SQLSTATE 55000,
    object_not_in_prerequisite_state: hold of a running run, freeze of a queued one); the message
    says which run, its state and what may be done instead."""


def _run_request(conn: Connection, function: str, run_id: uuid.UUID) -> Transition:
    try:
        row = conn.execute(sql.SQL("SELECT state, changed FROM unitvisor.{}(%s)").format(sql.Identifier(function)),
                           (run_id,)).fetchone()
    except psycopg.errors.ObjectNotInPrerequisiteState as exc:
        hint = exc.diag.message_hint
        raise Refused((exc.diag.message_primary or one_line(exc)) + (f" ({hint})" if hint else "")) from None
    return Transition(row[0], row[1])


def hold_run(conn: Connection, run_id: uuid.UUID) -> Transition:
    """Hold a queued run (unitvisor.hold_run): never claimed until released. Refused for a run that is
    not queued; changed=False when it is held already."""
    return _run_request(conn, "hold_run", run_id)


def release_run(conn: Connection, run_id: uuid.UUID) -> Transition:
    """Release a held run (unitvisor.release_run): claimed as any queued run. changed=False: not held."""
    return _run_request(conn, "release_run", run_id)


def freeze_run(conn: Connection, run_id: uuid.UUID) -> Transition:
    """Ask the host of a running run to freeze its unit (unitvisor.freeze_run); the host acts on it."""
    return _run_request(conn, "freeze_run", run_id)


def thaw_run(conn: Connection, run_id: uuid.UUID) -> Transition:
    """Ask the host of a running run to thaw its unit (unitvisor.thaw_run)."""
    return _run_request(conn, "thaw_run", run_id)


def hold_of(conn: Connection, run_id: uuid.UUID) -> tuple[datetime | None, str | None]:
    """When and by whom a run is held (None, None: not held)."""
    row = conn.execute("SELECT held_at, held_by FROM unitvisor.runs WHERE id = %s", (run_id,)).fetchone()
    return (row[0], row[1]) if row else (None, None)


def freezes_of(conn: Connection, run_id: uuid.UUID) -> dict[int, dict[str, Any]]:
    """Each attempt's freeze that was ever asked for, by attempt number: what was asked, what its host
    did, and the two in words (unitvisor.freeze_text)."""
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(
            """SELECT a.attempt, a.freeze_wanted AS wanted, a.freeze_requested_at AS requested_at,
                      a.freeze_requested_by AS requested_by, a.freeze_state AS state, a.freeze_refused AS refused,
                      a.freeze_acted_at AS acted_at, unitvisor.freeze_pending(a) AS pending,
                      unitvisor.freeze_text(a) AS text
               FROM unitvisor.attempts a WHERE a.run_id = %s AND a.freeze_requested_at IS NOT NULL
               ORDER BY a.attempt""", (run_id,)).fetchall()
    return {row.pop("attempt"): row for row in rows}


@dataclass(frozen=True)
class FreezeRequest:
    run_id: uuid.UUID
    attempt: int
    unit_name: str
    wanted: str  # 'frozen' or 'thawed'
    requested_at: datetime  # the request's own time, handed back to record_freeze


def freeze_requests(conn: Connection, fence: Fence) -> list[FreezeRequest]:
    """This host's pending freeze requests, oldest first (fenced)."""
    with _fencing():
        rows = conn.execute("SELECT run_id, attempt, unit_name, wanted, requested_at "
                            "FROM unitvisor.freeze_requests(%s, %s)", (fence.host_id, fence.epoch)).fetchall()
    return [FreezeRequest(*row) for row in rows]


def record_freeze(conn: Connection, fence: Fence, request: FreezeRequest, state: str, refused: str | None) -> bool:
    """What this host did with a freeze request: the unit's freezer state after it ('frozen' or
    'thawed') and why it was refused (None: done). False: the attempt is no longer open here."""
    with _fencing():
        return conn.execute("SELECT unitvisor.record_freeze(%s, %s, %s, %s, %s, %s, %s)",
                            (fence.host_id, fence.epoch, request.run_id, request.attempt, request.requested_at,
                             state, refused)).fetchone()[0]


# -- hosts --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HostProfile:
    """What a daemon registers about its host: who it is, and what it may run (the claim filters on it)."""

    host_id: str
    name: str
    instance: str
    max_runs: int
    memory_budget: int | None
    version: str
    boot_id: str
    allowed_executables: tuple[str, ...]
    executable_patterns: tuple[str, ...]
    run_user: str
    allowed_users: tuple[str, ...]
    environment_denied: tuple[str, ...]  # regexes (supervisor/envpolicy.py)
    environment_names: tuple[str, ...]  # allowed_environment's plain names
    environment_patterns: tuple[str, ...]  # its patterns, as regexes
    can_start: bool
    cannot_start_reason: str | None
    poll_interval: float
    dead_after: float
    # Placement (schema 033): [host] labels; a run's host_labels must all be among them.
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Registration:
    registered: bool  # False: another live daemon holds this host id; nothing was changed
    state: str | None
    epoch: int | None
    detail: str
    # The instance this registration took the id from (another machine, or this one before a reboot),
    # None when it was this instance's already, new, or recorded none (a 0.5.x daemon's). Its open
    # attempts are the caller's to settle `lost` in the same transaction (Reconciler.take_over_id).
    taken_from: str | None = None


def register_host(conn: Connection, profile: HostProfile) -> Registration:
    """Take this host's id (its session lock, then its row) for this daemon, or learn that another
    live daemon holds it. A draining host stays draining; a dead one comes back active, fenced off
    from everything that was taken over by a new epoch. Called inside the caller's transaction when it
    must settle what it took over (`taken_from`) in the same one."""
    p = profile
    with conn.transaction():
        # Read before: once registered, the row names this instance. A registration between this read
        # and the call takes the session lock first, so the call is refused (or it was this instance).
        before = conn.execute("SELECT instance FROM unitvisor.hosts WHERE id = %s", (p.host_id,)).fetchone()
        row = conn.execute(
            """SELECT registered, state, epoch, detail FROM unitvisor.register_host(
                   %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)""",
            (p.host_id, p.name, p.instance, p.max_runs, p.memory_budget, p.version, p.boot_id,
             list(p.allowed_executables), list(p.executable_patterns), p.run_user, list(p.allowed_users),
             p.can_start, p.cannot_start_reason, p.poll_interval, p.dead_after)).fetchone()
        if row[0]:
            # In the same transaction: no claim may see this host without its environment policy.
            conn.execute("SELECT unitvisor.register_host_allowlist(%s, %s, %s, %s, %s)",
                         (p.host_id, row[2], list(p.environment_denied), list(p.environment_names),
                          list(p.environment_patterns)))
            conn.execute("SELECT unitvisor.register_host_labels(%s, %s, %s)", (p.host_id, row[2], Jsonb(p.labels)))
    previous = before[0] if before else None
    taken_from = previous if row[0] and previous is not None and previous != p.instance else None
    return Registration(row[0], row[1], row[2], row[3], taken_from)


def register_wake_channel(conn: Connection, fence: Fence) -> str:
    """LISTEN on the channel that tells this host of jobs that name it alone, and mark the host as
    listening there (sql/migrations/048_named_hosts_told_alone.sql): in the registration's transaction,
    where the LISTEN takes effect at the same commit as the mark. Returns the channel."""
    channel = conn.execute("SELECT unitvisor.register_wake_channel(%s, %s)",
                           (fence.host_id, fence.epoch)).fetchone()[0]
    listen(conn, channel)
    return channel


def host_fence(conn: Connection, host_id: str) -> tuple[str, Fence] | None:
    """A host's state and current fence, for a one-off pass by hand (`unitvisor reconcile`)."""
    row = conn.execute("SELECT state, epoch FROM unitvisor.hosts WHERE id = %s", (host_id,)).fetchone()
    return (row[0], Fence(host_id, row[1])) if row else None


def list_hosts(conn: Connection) -> list[dict[str, Any]]:
    """Every host with its heartbeat age (by the database's clock) and its runs in flight."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(
            """SELECT h.id, h.name, h.state, h.max_runs, h.memory_budget, h.version, h.started_at,
                      h.heartbeat_at, extract(epoch FROM now() - h.heartbeat_at)::float8 AS heartbeat_age,
                      h.epoch, h.instance, h.can_start, h.cannot_start_reason, h.allowed_executables,
                      h.run_user, h.allowed_users, h.poll_interval_sec, h.dead_after_sec, h.dead_at, h.dead_reason,
                      h.conflict_detail, extract(epoch FROM now() - h.conflict_at)::float8 AS conflict_age,
                      h.down_confirmed_at, h.down_confirmed_by, h.returned_late_at,
                      h.pressure_state, h.pressure_resource, h.pressure_figures, h.pressure_detail,
                      extract(epoch FROM now() - h.pressure_at)::float8 AS pressure_age,
                      h.pressure_at IS NOT NULL AND h.pressure_at < h.started_at AS pressure_stale,
                      unitvisor.host_in_flight(h.id) AS in_flight,
                      h.left_draining OR (h.state = 'dead' AND h.drained_before_death) AS comes_back_draining,
                      unitvisor.host_labels(h) AS labels
               FROM unitvisor.hosts h ORDER BY h.id""").fetchall()


def set_host_state(conn: Connection, host_id: str, state: str) -> str | None:
    """Drain (claim nothing new) or undrain a host. Returns the previous state, None if no such host.
    A dead host's state is not changed: it becomes active again only by registering. A stopped host
    stays stopped and keeps the drain for its next registration; its previous state is `stopped` or
    `stopped (drained)` (sql/migrations/024_drain_through_stop.sql). Through unitvisor.set_host_state
    (sql/021_operator.sql), so that a host role may drain its own host id, and only that one, while the
    admin drains any (insufficient_privilege otherwise)."""
    return conn.execute("SELECT unitvisor.set_host_state(%s, %s)", (host_id, state)).fetchone()[0]


def confirm_host_down(conn: Connection, host_id: str) -> str | None:
    """The operator's word that a host is down: declared dead once overdue, whatever the fleet-wide
    guards say (sql/migrations/036_fleet_silent.sql). Returns the host's state (a dead host is left as
    it is), None if no such host. The database owner's: insufficient_privilege for any other role."""
    return conn.execute("SELECT unitvisor.confirm_host_down(%s)", (host_id,)).fetchone()[0]


@dataclass(frozen=True)
class Forgotten:
    """What `retire_host` did. state: the host's state (None: no such host row); open_count: its open
    attempts (then nothing was removed); role: the login role bound to it (None: none); role_fate:
    `dropped`, `disabled` (NOLOGIN and out of unitvisor_host: it still owns something, `kept_because`
    says what), `kept` (asked to) or None (no role, or nothing removed)."""

    state: str | None
    open_count: int
    role: str | None = None
    role_fate: str | None = None
    kept_because: str = ""


class RoleNotDropped(DatabaseError):
    """The session may not drop or disable the host's login role (it needs the right to create roles)."""

    def __init__(self, role: str, detail: str) -> None:
        super().__init__(detail)
        self.role = role


def forget_host(conn: Connection, host_id: str) -> tuple[str | None, int]:
    """Remove a dead or stopped host's row once none of its attempts is open, leaving its login role as
    it is. Returns the host's state (None: no such host) and how many of its attempts are still open
    (then nothing was removed)."""
    forgotten = retire_host(conn, host_id, keep_role=True)
    return forgotten.state, forgotten.open_count


def retire_host(conn: Connection, host_id: str, keep_role: bool = False) -> Forgotten:
    """Remove a dead or stopped host's row once none of its attempts is open, and with it the login role
    bound to its id (unless keep_role): DROP ROLE, or where the role still owns something (in any
    database of the cluster) NOLOGIN and out of unitvisor_host, so that its DSN logs in nowhere and
    reads nothing. A role whose host row was forgotten before (by 0.7.0, or with keep_role) is dropped
    too. One transaction: the row stays when the role cannot be touched (RoleNotDropped: the session
    needs the right to create roles, as for `hosts add`). A drained host whose daemon stopped (the
    README's retirement: drain, wait, apt purge) is `stopped` since schema 24, and goes as one."""
    with conn.transaction():
        row = conn.execute("SELECT h.state FROM unitvisor.hosts h WHERE h.id = %s FOR UPDATE", (host_id,)).fetchone()
        open_count = 0
        if row is not None:
            open_count = conn.execute("SELECT count(*) FROM unitvisor.attempts WHERE host_id = %s AND outcome IS NULL",
                                      (host_id,)).fetchone()[0]
            if row[0] not in ("dead", "stopped") or open_count:
                return Forgotten(row[0], open_count)
            conn.execute("DELETE FROM unitvisor.hosts WHERE id = %s", (host_id,))
        bound = conn.execute("SELECT role_name FROM unitvisor.host_roles WHERE host_id = %s FOR UPDATE",
                             (host_id,)).fetchone()
        state = row[0] if row else None
        if bound is None:
            return Forgotten(state, 0)
        role = bound[0]
        if keep_role:
            return Forgotten(state, 0, role, "kept") if row else Forgotten(None, 0)
        conn.execute("DELETE FROM unitvisor.host_roles WHERE role_name = %s", (role,))
        fate, because = _drop_or_disable_role(conn, role)
    return Forgotten(state, 0, role, fate, because)


def _drop_or_disable_role(conn: Connection, role: str) -> tuple[str, str]:
    """DROP ROLE; where something of the cluster depends on it (objects it owns or privileges granted
    to it, in any database), NOLOGIN and out of unitvisor_host instead, which needs no such cleanup."""
    name = sql.Identifier(role)
    if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone() is None:
        return "dropped", ""  # dropped by hand already: only its binding was left
    try:
        with conn.transaction():
            conn.execute(sql.SQL("DROP ROLE {}").format(name))
        return "dropped", ""
    except psycopg.errors.DependentObjectsStillExist as exc:
        because = one_line(exc)
    except psycopg.errors.InsufficientPrivilege as exc:
        raise RoleNotDropped(role, one_line(exc)) from None
    try:
        conn.execute(sql.SQL("ALTER ROLE {} NOLOGIN").format(name))
        conn.execute(sql.SQL("REVOKE {} FROM {}").format(sql.Identifier(HOST_ROLE), name))
    except psycopg.errors.InsufficientPrivilege as exc:
        raise RoleNotDropped(role, one_line(exc)) from None
    return "disabled", because


@dataclass(frozen=True)
class Probe:
    host_state: str
    claimable: bool  # a spawn job this host would run is due
    cancels: bool  # an open attempt of this host has a cancel request
    upkeep: bool  # fleet upkeep is due: a silent host to declare dead, or runs waiting long


def probe(conn: Connection, fence: Fence, waited: timedelta,
          left_to_woken: timedelta = timedelta(0)) -> Probe:
    """The heartbeat and the fallback poll in one statement: an idle daemon asks the database one
    question per poll interval, and only claims, looks for cancels or does fleet upkeep when there is
    something. A job due when it was made is not "work" until it is `left_to_woken` old: its submit
    notified the hosts to take it (sql/migrations/047_fresh_jobs_left_to_the_woken.sql). Raises Fenced
    when this host's epoch is over (declared dead, taken over, row deleted)."""
    row = conn.execute("SELECT host_state, claimable, cancels, upkeep FROM unitvisor.heartbeat(%s, %s, %s, %s)",
                       (fence.host_id, fence.epoch, waited, left_to_woken)).fetchone()
    if row is None:
        raise Fenced(f"host {fence.host_id} is fenced: its row is gone, or its epoch {fence.epoch} is over")
    return Probe(row[0], row[1], row[2], row[3])


def set_pressure(conn: Connection, fence: Fence, state: str, resource: str | None, figures: dict[str, float],
                 detail: str) -> None:
    """Report this host's admission by pressure (supervisor/pressure.py) in its row: `hosts` shows it,
    and while it is `stopped` the database's claim and a waiting run's reason treat the host as one
    that refuses every run (unitvisor.host_refusal, sql/migrations/018_admission_pressure.sql)."""
    with _fencing():
        conn.execute("SELECT unitvisor.set_host_pressure(%s, %s, %s, %s, %s, %s)",
                     (fence.host_id, fence.epoch, state, resource, Jsonb(figures), detail))


def mark_host_stopped(conn: Connection, fence: Fence) -> None:
    conn.execute("SELECT unitvisor.mark_host_stopped(%s, %s)", (fence.host_id, fence.epoch))


# -- fleet upkeep -------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeadHost:
    host_id: str
    silent: float  # seconds
    dead_after: float  # seconds, the host's own host_dead_after


def declare_dead_hosts(conn: Connection, fence: Fence, connected_for: float) -> list[DeadHost]:
    """Inside the caller's transaction: mark every host silent for longer than its host_dead_after as
    dead (one daemon of the fleet at a time; the others get []). Their open attempts are the caller's
    to settle in the same transaction."""
    with _fencing():
        rows = conn.execute("SELECT host_id, silent_sec, dead_after_sec FROM unitvisor.declare_dead_hosts(%s, %s, %s)",
                            (fence.host_id, fence.epoch, connected_for)).fetchall()
    return [DeadHost(row[0], row[1], row[2]) for row in rows]


@dataclass(frozen=True)
class Declaration:
    """One pass of declare_dead: the hosts declared dead, and how many more silent hosts were held back
    and why ('declarer-late', 'fleet-late', 'fleet-silent', 'fleet-recovering' or 'cap'; None when none was)."""

    dead: list[DeadHost]
    held: int = 0
    held_why: str | None = None
    held_detail: str = ""


def declare_dead(conn: Connection, fence: Fence, connected_for: float, max_hosts: int) -> Declaration:
    """declare_dead_hosts with the guards of schema 19 (sql/019_fleet_upkeep.sql) and 36: nobody while
    this host's own heartbeat, or most of the fleet's, is late, nor while most of the fleet is silent at
    once (but the hosts an operator confirmed down), and at most `max_hosts` at once. Inside the
    caller's transaction, whose job it is to settle the declared hosts' open attempts in it."""
    with _fencing():
        rows = conn.execute(
            "SELECT host_id, silent_sec, dead_after_sec, held, held_why, held_detail "
            "FROM unitvisor.declare_dead(%s, %s, %s, %s)",
            (fence.host_id, fence.epoch, connected_for, max_hosts)).fetchall()
    dead = [DeadHost(row[0], row[1], row[2]) for row in rows if row[0] is not None]
    if not rows or not rows[0][3]:
        return Declaration(dead)
    return Declaration(dead, rows[0][3], rows[0][4], rows[0][5] or "")


def fleet_upkeep_turn(conn: Connection, fence: Fence, every: timedelta) -> bool:
    """Whether this host does the fleet's upkeep now: true for one live host of the fleet per `every`
    (a lease row; committed on return, whatever the upkeep then does)."""
    with _fencing():
        return bool(conn.execute("SELECT unitvisor.fleet_upkeep_turn(%s, %s, %s)",
                                 (fence.host_id, fence.epoch, every)).fetchone()[0])


@dataclass(frozen=True)
class ScheduleTurn:
    """What one submit_due_schedules pass did with one due schedule (sql/migrations/028_schedules.sql)."""

    schedule: str
    due: datetime
    run_id: uuid.UUID | None  # None: nothing submitted (skipped, missed, refused)
    result: str  # 'submitted', 'submitted late ...', 'skipped: ...', 'missed ...', 'refused: ...'
    missed: int  # due times reached more than a minute late


def submit_due_schedules(conn: Connection, fence: Fence, max_schedules: int = 100) -> list[ScheduleTurn]:
    """Submit the run of every schedule due now (at most `max_schedules` a pass) and move each on to its
    next due time, in one statement (autocommit): one run per due time across the fleet, whoever calls."""
    with _fencing():
        rows = conn.execute("SELECT schedule, due, run_id, result, missed "
                            "FROM unitvisor.submit_due_schedules(%s, %s, %s)",
                            (fence.host_id, fence.epoch, max_schedules)).fetchall()
    return [ScheduleTurn(*row) for row in rows]


def list_schedules(conn: Connection) -> list[dict[str, Any]]:
    """Every schedule with its next and last due time, and the state of its last run (None once pruned)."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(
            """SELECT s.name, s.cron, s.timezone, s.overlap, s.catch_up, s.paused, s.next_due, s.last_due,
                      s.last_run_id, r.state AS last_run_state, s.last_result, s.last_at, s.submitted, s.skipped,
                      s.missed, s.run, s.created_at, s.created_by
               FROM unitvisor.schedules s LEFT JOIN unitvisor.runs r ON r.id = s.last_run_id
               ORDER BY s.name""").fetchall()


def set_limit(conn: Connection, name: str, selector: dict[str, str], max_live: int) -> bool:
    """Create or change a named limit (sql/migrations/032_concurrency_limits.sql): at most `max_live` runs
    whose labels hold every pair of `selector` live at once in the fleet. True: created; False: changed.
    An argument the database refuses is a DatabaseError whose message names it."""
    try:
        return conn.execute("SELECT unitvisor.set_limit(%s, %s, %s)", (name, Jsonb(selector), max_live)).fetchone()[0]
    except psycopg.errors.CheckViolation as exc:
        raise DatabaseError(f"the database refused the limit: {exc.diag.message_primary or one_line(exc)}") from None


def drop_limit(conn: Connection, name: str) -> bool:
    """Drop a named limit; False when there was none of that name."""
    return conn.execute("SELECT unitvisor.drop_limit(%s)", (name,)).fetchone()[0]


def list_limits(conn: Connection) -> list[dict[str, Any]]:
    """Every named limit with its live runs now, by name (unitvisor.limit_status)."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute("SELECT name, selector, max_live, live, set_at, set_by FROM unitvisor.limit_status()"
                           ).fetchall()


def renew_heartbeat(conn: Connection, fence: Fence) -> str | None:
    """The heartbeat alone (no question about work): the host's state, or None when its epoch is over
    (the loop's next probe then finds it fenced and registers again)."""
    return conn.execute("SELECT unitvisor.renew_heartbeat(%s, %s)", (fence.host_id, fence.epoch)).fetchone()[0]


def expire_runs(conn: Connection, fence: Fence) -> int:
    """End as `expired` every queued run past its start deadline that never started (any host may, as
    any may explain why a run waits); returns how many."""
    with _fencing():
        return conn.execute("SELECT unitvisor.expire_runs(%s, %s)", (fence.host_id, fence.epoch)).fetchone()[0]


@dataclass(frozen=True)
class PassFigures:
    """The fleet-wide figures a reconcile pass takes for the metrics."""

    skipped: int  # runs skipped (schema 035) that no daemon had counted: now counted by this one
    limits: dict[str, tuple[int, int]]  # each named limit (schema 032): (runs live now, max_live)


def pass_figures(conn: Connection, fence: Fence) -> PassFigures:
    """Take the runs skipped that no daemon has counted yet (unitvisor.count_skips: each skip is taken by
    one daemon of the fleet, so that the fleet's counters summed have every skip once), and read each
    named limit's live runs (unitvisor.limit_status), in one statement: an idle daemon's statements are
    what an idle fleet costs its database (issue 23), and these two were two of its nine a minute."""
    with _fencing():
        skipped, limits = conn.execute(
            """SELECT unitvisor.count_skips(%s, %s),
                      (SELECT coalesce(jsonb_agg(jsonb_build_array(l.name, l.live, l.max_live)), '[]')
                       FROM unitvisor.limit_status() l)""", (fence.host_id, fence.epoch)).fetchone()
    return PassFigures(skipped, {name: (live, max_live) for name, live, max_live in limits})


_PRUNED_COLUMNS = "runs, attempts, events, jobs, busy"


def prune_batch(conn: Connection, older_than: timedelta, batch_size: int, fence: Fence | None = None) -> Pruned:
    """Delete one batch of finished runs (with their attempts, events and jobs) and old claimed or
    discarded jobs, older than `older_than`, and commit it (autocommit: one statement, one transaction,
    so that locks last one batch). As the admin, or with `fence` as that host (unitvisor.prune_history,
    which refuses an age under its floor)."""
    with _fencing():
        if fence is None:
            row = conn.execute(f"SELECT {_PRUNED_COLUMNS} FROM unitvisor.prune(%s, %s)",
                               (older_than, batch_size)).fetchone()
        else:
            row = conn.execute(f"SELECT {_PRUNED_COLUMNS} FROM unitvisor.prune_history(%s, %s, %s, %s)",
                               (fence.host_id, fence.epoch, older_than, batch_size)).fetchone()
    return Pruned(*row)


# A dry run counts the whole backlog in one statement, which for millions of rows may take longer
# than the session's statement_timeout (SESSION_SETTINGS): a one-off command by hand may wait.
DRY_RUN_TIMEOUT = "10min"


def prune_count(conn: Connection, older_than: timedelta) -> Pruned:
    """What pruning at `older_than` would delete now, in all (unitvisor.prune's dry run)."""
    with conn.transaction():
        conn.execute("SELECT set_config('statement_timeout', %s, true)", (DRY_RUN_TIMEOUT,))
        row = conn.execute(f"SELECT {_PRUNED_COLUMNS} FROM unitvisor.prune(%s, 1, true)", (older_than,)).fetchone()
    return Pruned(*row)


def explain_waiting(conn: Connection, waited: timedelta, batch: int = 1000) -> int:
    """Record why each run due for longer than `waited` waits, when no live host accepts it, for at
    most `batch` runs, going on where the last pass stopped; returns how many runs got a new reason
    (each with an event)."""
    return conn.execute("SELECT unitvisor.explain_waiting(%s, %s)", (waited, batch)).fetchone()[0]


# -- the daemon's queries -----------------------------------------------------------------------


def claim(conn: Connection, fence: Fence, batch: int, unit_format: str) -> list[tuple[Run, Attempt]]:
    """Claim up to `batch` spawn jobs that this host accepts, within its free capacity, memory budget
    and fair share (unitvisor.claim_jobs): each job, its new attempt row and the run's move to
    `starting` commit together, in one round trip."""
    with _fencing(), conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(
            f"""SELECT c.run_id AS claimed_run, c.attempt AS claimed_attempt, c.unit_name AS claimed_unit,
                       c.claimed_at AS claimed_claimed_at, {_DAEMON_RUN_COLUMNS}
                FROM unitvisor.claim_jobs(%s, %s, %s, %s) c LEFT JOIN unitvisor.runs r ON r.id = c.run_id""",
            (fence.host_id, fence.epoch, batch, unit_format)).fetchall()
    # A LEFT JOIN, so that claim_jobs always runs to its end: with an inner join the planner may skip the
    # function when runs looks empty, and a host role sees no run pinned elsewhere (the policy on runs), so
    # the stale jobs of such runs would never be discarded. A claimed run is one this host may read.
    # The run rows are as the statement's snapshot saw them: before claim_jobs set them to starting.
    # That snapshot is older than the one claim_jobs picks its jobs with (each statement inside it sees
    # later commits), so a run submitted in between is claimed without its row: it is read again, now.
    missing = [row["claimed_run"] for row in rows if row["id"] is None]
    if missing:
        with conn.cursor(row_factory=dict_row) as cur:
            late = {row["id"]: row for row in cur.execute(
                f"SELECT {_DAEMON_RUN_COLUMNS} FROM unitvisor.runs r WHERE r.id = ANY(%s)", (missing,)).fetchall()}
        unreadable = set(missing) - late.keys()
        if unreadable:  # the policy on runs lets a host read what it claimed: a bug, said as one
            raise RuntimeError(f"claimed runs this host cannot read: {', '.join(map(str, sorted(unreadable)))}")
        rows = [{**row, **late[row["claimed_run"]]} if row["id"] is None else row for row in rows]
    return [(Run(**{**{k: row[k] for k in _RUN_FIELDS}, "state": "starting"}),
             Attempt(run_id=row["claimed_run"], attempt=row["claimed_attempt"], host_id=fence.host_id,
                     unit_name=row["claimed_unit"], claimed_at=row["claimed_claimed_at"])) for row in rows]


def open_attempts(conn: Connection, host_id: str, unit_names: Sequence[str] | None = None,
                  cancel_requested: bool = False) -> list[tuple[Run, Attempt]]:
    """A host's attempts without an outcome, with their runs: all of them, those of the named units,
    or those whose run an operator asked to cancel. One statement, so one snapshot of both rows: it
    runs for every batch of unit changes that needs them (reconciler.change_needs_rows), on every run's
    path (docs/benchmarks.md, Statements per run).
    Every such run is one a host may read (the policy on runs, sql/migrations/004_roles.sql): its own attempt's,
    or a dead host's open attempt's."""
    rows = conn.execute(
        f"""SELECT {_ATTEMPT_COLUMNS}, {_DAEMON_RUN_COLUMNS}
            FROM unitvisor.attempts a JOIN unitvisor.runs r ON r.id = a.run_id
            WHERE a.host_id = %(host)s AND a.outcome IS NULL
              AND (%(names)s::text[] IS NULL OR a.unit_name = ANY(%(names)s::text[]))
              AND (NOT %(cancel)s OR r.cancel_requested_at IS NOT NULL)
            ORDER BY a.claimed_at""",
        {"host": host_id, "names": None if unit_names is None else list(unit_names),
         "cancel": cancel_requested}).fetchall()
    split = len(_ATTEMPT_FIELDS)
    return [(Run(*row[split:]), Attempt(*row[:split])) for row in rows]


def unclaimed_attempts(conn: Connection, attempts: Sequence[tuple[uuid.UUID, int]]) -> set[tuple[uuid.UUID, int]]:
    """Which (run, attempt) pairs name an attempt that no row records yet, of a run still in flight:
    a unit of that name is ahead of its claim (a restored backup, a hand-started unit), not an orphan."""
    if not attempts:
        return set()
    rows = conn.execute(
        """SELECT p.run_id, p.attempt FROM unnest(%s::uuid[], %s::int[]) AS p(run_id, attempt)
           JOIN unitvisor.runs r ON r.id = p.run_id AND r.state IN ('queued', 'starting', 'running')
           WHERE NOT EXISTS (SELECT 1 FROM unitvisor.attempts a
                             WHERE a.run_id = p.run_id AND a.attempt = p.attempt)""",
        ([a[0] for a in attempts], [a[1] for a in attempts])).fetchall()
    return {(row[0], row[1]) for row in rows}


@dataclass(frozen=True)
class UnitOwner:
    """Who the attempt of a unit name belongs to, as the database says now."""

    host_id: str | None  # None: a host whose run the caller may not see (sql/migrations/014_host_reads.sql)
    outcome: str | None  # None: still open


def unit_owners(conn: Connection, unit_names: Sequence[str]) -> dict[str, UnitOwner]:
    """The attempt rows behind these unit names (names with no row are absent). Read after the units
    were listed, so that an attempt claimed while the listing ran is seen as its host's, not as gone.
    Through unitvisor.unit_owners (sql/migrations/014_host_reads.sql): a host role does not read the attempts of a
    run pinned to another host, yet must learn that such a unit is held elsewhere (host_id None) or
    ended (outcome 'ended'), never take it for an orphan."""
    rows = conn.execute("SELECT unit_name, host_id, outcome FROM unitvisor.unit_owners(%s)",
                        (list(unit_names),)).fetchall()
    return {row[0]: UnitOwner(row[1], row[2]) for row in rows}


def mark_started(conn: Connection, fence: Fence, attempt: Attempt, invocation_id: str | None,
                 reason: str | None = None, *, started_at: datetime | None = None) -> None:
    """The unit exists: the run is running. Idempotent (adoption calls it again); the event with
    `reason` is written once, when the run moves to running. One statement: it is on every run's path.
    `started_at` is systemd's own time of the start when known (else now()); a start time already
    recorded is kept."""
    with _fencing():
        conn.execute("SELECT unitvisor.mark_started(%s, %s, %s, %s, %s, %s, %s)",
                     (attempt.run_id, attempt.attempt, fence.host_id, fence.epoch, invocation_id or None, started_at,
                      reason or f"unit {attempt.unit_name} started"))


def mark_started_many(conn: Connection, fence: Fence, attempts: Sequence[Attempt]) -> None:
    """`mark_started` of units the daemon has just created, one statement for a claimed batch: each
    run's start would otherwise wait for a round trip to the database of its own (issue 14). The
    function is the same, called once per row, in one transaction: all are marked or none."""
    if not attempts:
        return
    with _fencing():
        conn.execute("SELECT unitvisor.mark_started(t.run_id, t.attempt, %s, %s, NULL, NULL, t.reason) "
                     "FROM unnest(%s::uuid[], %s::integer[], %s::text[]) AS t(run_id, attempt, reason)",
                     (fence.host_id, fence.epoch, [a.run_id for a in attempts], [a.attempt for a in attempts],
                      [f"unit {a.unit_name} started" for a in attempts]))


def record_outcome(conn: Connection, fence: Fence, attempt: Attempt, outcome: Outcome, next_state: str,
                   retry_delay: timedelta | None = None, invocation_id: str | None = None, *,
                   started_at: datetime | None = None, ended_at: datetime | None = None,
                   accounting: Accounting | None = None) -> bool:
    """Write an attempt's outcome and move its run to `next_state`, in one transaction, as `fence`'s
    host (the attempt's own host, or a host taking over a dead one's attempts).

    With a retry_delay the run goes back to `queued` and a new spawn job, scheduled after the delay,
    is created in this same transaction. Returns False, changing nothing, when the attempt already
    had an outcome: a recorded outcome is never overwritten. Raises Fenced when the writer's epoch is over.

    `started_at` and `ended_at` are systemd's own times (from the unit, or the journal) when known, so
    that a daemon that was down when the run ended does not stretch its duration; now() otherwise. A
    start time already recorded is kept.

    `accounting` (systemd's measurements of the unit) is kept with the outcome (schema 007); None
    stores NULLs: nothing measured.
    """
    # One statement text for one outcome and for many (record_outcomes): the same function, the same
    # arguments, so that they cannot drift apart.
    return record_outcomes(conn, fence, [Settling(attempt, outcome, next_state, retry_delay, invocation_id,
                                                  started_at, ended_at, accounting)])[0]


@dataclass(frozen=True)
class Settling:
    """One attempt's outcome for `record_outcomes`: record_outcome's arguments, but the writer's."""

    attempt: Attempt
    outcome: Outcome
    next_state: str
    retry_delay: timedelta | None = None
    invocation_id: str | None = None
    started_at: datetime | None = None
    ended_at: datetime | None = None
    accounting: Accounting | None = None


def host_clock() -> datetime:
    """This host's clock, sent with its outcomes: the database moves the times systemd read on this
    host by the difference between its own clock and this one (sql/migrations/013_fleet_promises.sql), so that an
    attempt's start (the database's clock) and end (this host's) make a duration on one clock."""
    return datetime.now(UTC)


def record_outcomes(conn: Connection, fence: Fence, records: Sequence[Settling]) -> list[bool]:
    """`record_outcome` of several attempts in one statement, so one transaction: all are written or
    none (a fenced writer, or one row the function refuses, fails them all). Returns, in order,
    whether each attempt took its outcome. The daemon's loop settles the units that ended together
    this way: one round trip to the database for them instead of one each (issue 14)."""
    if not records:
        return []
    measured = [r.accounting or Accounting() for r in records]
    with _fencing():
        rows = conn.execute(
            "SELECT t.n, unitvisor.record_outcome(t.run_id, t.attempt, %s, %s, t.outcome, t.exit_status, t.reason, "
            "t.next_state, t.retry_delay, t.invocation_id, t.started_at, t.ended_at, t.cpu_usage_nsec, "
            "t.memory_peak_bytes, t.io_read_bytes, t.io_write_bytes, %s::timestamptz, t.tasks_peak) "
            "FROM unnest(%s::uuid[], %s::integer[], %s::text[], %s::text[], %s::text[], %s::text[], %s::interval[], "
            "%s::text[], %s::timestamptz[], %s::timestamptz[], %s::bigint[], %s::bigint[], %s::bigint[], "
            "%s::bigint[], %s::bigint[]) WITH ORDINALITY AS t(run_id, attempt, outcome, exit_status, reason, "
            "next_state, retry_delay, invocation_id, started_at, ended_at, cpu_usage_nsec, memory_peak_bytes, "
            "io_read_bytes, io_write_bytes, tasks_peak, n) ORDER BY t.n",
            (fence.host_id, fence.epoch, host_clock(), [r.attempt.run_id for r in records],
             [r.attempt.attempt for r in records],
             [r.outcome.outcome for r in records], [r.outcome.exit_status for r in records],
             [r.outcome.reason for r in records], [r.next_state for r in records],
             [r.retry_delay for r in records], [r.invocation_id or None for r in records],
             [r.started_at for r in records], [r.ended_at for r in records],
             [m.cpu_usage_nsec for m in measured], [m.memory_peak_bytes for m in measured],
             [m.io_read_bytes for m in measured], [m.io_write_bytes for m in measured],
             [m.tasks_peak for m in measured])).fetchall()
    return [bool(took) for _, took in rows]


def record_output_tails(conn: Connection, fence: Fence, tails: Sequence[tuple[uuid.UUID, int, str]]) -> int:
    """Keep the output tails (run id, attempt, tail) of `fence`'s host's ended attempts, in one
    statement; an attempt that already has one keeps it. Returns how many took theirs."""
    if not tails:
        return 0
    with _fencing():
        return conn.execute(
            "SELECT unitvisor.record_output_tails(%s, %s, %s::uuid[], %s::integer[], %s::text[])",
            (fence.host_id, fence.epoch, [t[0] for t in tails], [t[1] for t in tails],
             [t[2] for t in tails])).fetchone()[0]


# -- the River source (schema 034, supervisor/river.py, docs/river.md) --------------------------------
#
# River's tables live in the platform's schema, named by [river] schema: that name is an identifier
# composed with psycopg.sql (never formatted as text), as is the spec function's; every value is a
# parameter.


class RiverMisconfigured(DatabaseError):
    """A claim of River jobs failed on the platform's configuration (river.refuses_job): nothing was
    claimed, and every job stays available."""


@dataclass(frozen=True)
class RiverClaim:
    """A River job claimed: the run it became, or why it was discarded instead."""

    job_id: int
    attempt: int
    run_id: uuid.UUID | None
    refused: str | None


def _river(schema: str, table: str) -> sql.Composable:
    return sql.Identifier(schema, table)


def river_grant(conn: Connection) -> tuple[str, bool]:
    """This session's login role, and whether it may call the River source's functions (a member of
    unitvisor_river, or the admin): asked at connect, so that a daemon with [river] but without that grant
    says so at once rather than at its first claim."""
    with conn.transaction():
        role, may = conn.execute(
            "SELECT session_user, has_function_privilege('unitvisor.submit_river_run(text,bigint,jsonb,bigint)', "
            "'EXECUTE')").fetchone()
    return role, bool(may)


def river_versions(conn: Connection, schema: str) -> list[int] | None:
    """The main line's versions in <schema>.river_migration; None when River's table is not there."""
    with conn.transaction():
        exists = conn.execute("SELECT to_regclass(format('%%I.river_migration', %s::text)) IS NOT NULL",
                              (schema,)).fetchone()[0]
        if not exists:
            return None
        rows = conn.execute(sql.SQL("SELECT version FROM {} WHERE line = 'main' ORDER BY version").format(
            _river(schema, "river_migration"))).fetchall()
    return [row[0] for row in rows]


def claim_river_jobs(conn: Connection, fence: Fence, schema: str, queues: Sequence[str], kinds: Sequence[str],
                     spec_function: str, client: str, limit: int, now: Callable[[], datetime]) -> list[RiverClaim]:
    """Claim up to `limit` available River jobs of `queues` and `kinds` as River's producer does (due,
    queue not paused, by priority, scheduled_at, id; FOR UPDATE SKIP LOCKED; running, attempt + 1,
    attempted_at, `client` appended to attempted_by), and make each a run in the same transaction: the
    platform's spec function's result given to unitvisor.submit_river_run. A job whose run is refused is
    discarded in the same transaction with River's error element (`now()` stamps it). A configuration
    error rolls the whole claim back (RiverMisconfigured)."""
    spec_name = sql.Identifier(*spec_function.split("."))
    claimed: list[RiverClaim] = []
    try:
        with _fencing(), conn.transaction():
            rows = conn.execute(sql.SQL("""
                WITH locked AS (
                    SELECT j.id FROM {job} j
                    WHERE j.state = 'available' AND j.queue = ANY(%(queues)s) AND j.kind = ANY(%(kinds)s)
                      AND j.scheduled_at <= now()
                      AND NOT EXISTS (SELECT 1 FROM {queue} q WHERE q.name = j.queue AND q.paused_at IS NOT NULL)
                    ORDER BY j.priority, j.scheduled_at, j.id
                    LIMIT %(limit)s
                    FOR UPDATE SKIP LOCKED)
                UPDATE {job} j SET state = 'running', attempt = j.attempt + 1, attempted_at = now(),
                    attempted_by = (coalesce(j.attempted_by, '{{}}') || %(client)s::text)
                        [greatest(1, coalesce(array_length(j.attempted_by, 1), 0) + 2 - %(keep)s):]
                FROM locked WHERE j.id = locked.id
                RETURNING j.id, j.attempt, j.args, j.kind""").format(
                    job=_river(schema, "river_job"), queue=_river(schema, "river_queue")),
                {"queues": list(queues), "kinds": list(kinds), "limit": limit, "client": client,
                 "keep": river.ATTEMPTED_BY_MAX}).fetchall()
            for job_id, attempt, args, kind in sorted(rows, key=lambda row: row[0]):
                try:
                    with conn.transaction():
                        run_id = conn.execute(sql.SQL(
                            "SELECT unitvisor.submit_river_run(%s, %s, {}(%s::jsonb, %s::text, %s::bigint), %s)"
                        ).format(spec_name), (fence.host_id, fence.epoch, Jsonb(args), kind, job_id,
                                              job_id)).fetchone()[0]
                    claimed.append(RiverClaim(job_id, attempt, run_id, None))
                except psycopg.Error as exc:
                    if exc.sqlstate == FENCED_SQLSTATE or not river.refuses_job(exc.sqlstate):
                        raise
                    refused = exc.diag.message_primary or one_line(exc)
                    finish_river_job(conn, schema, job_id, attempt, river.Finish.DISCARDED,
                                     river.attempt_error(now(), attempt, refused))
                    claimed.append(RiverClaim(job_id, attempt, None, refused))
    except psycopg.Error as exc:
        # Rolled back: nothing claimed. A configuration error is said as one (every job stays available).
        if exc.sqlstate and exc.sqlstate != FENCED_SQLSTATE and not river.refuses_job(exc.sqlstate):
            raise RiverMisconfigured(f"River source: {one_line(exc)}") from None
        raise
    return claimed


def held_river_jobs(conn: Connection, schema: str, queues: Sequence[str], kinds: Sequence[str],
                    client: str, limit: int = 1000) -> list[river.HeldJob]:
    """The River jobs this host holds: running, of its queues and kinds, claimed last by `client`; and
    those claimed last by a host declared dead (unitvisor.hosts), which nobody else would finish: every
    live host's pass looks at them, and the finish's guard (state and attempt) lets one write."""
    rows = conn.execute(sql.SQL("""
        SELECT j.id, j.attempt, j.metadata ? 'cancel_attempted_at' FROM {job} j
        WHERE j.state = 'running' AND j.queue = ANY(%(queues)s) AND j.kind = ANY(%(kinds)s)
          AND j.attempted_by[array_length(j.attempted_by, 1)] = ANY(
              %(client)s::text || ARRAY(SELECT %(prefix)s || h.id FROM unitvisor.hosts h WHERE h.state = 'dead'))
        ORDER BY j.id LIMIT %(limit)s""").format(job=_river(schema, "river_job")),
        {"queues": list(queues), "kinds": list(kinds), "client": client, "prefix": river.CLIENT_PREFIX,
         "limit": limit}).fetchall()
    return [river.HeldJob(*row) for row in rows]


def river_runs(conn: Connection, fence: Fence, job_ids: Sequence[int]) -> dict[int, river.LinkedRun]:
    """The runs made from these River jobs (unitvisor.river_runs), by job id."""
    with _fencing():
        rows = conn.execute("SELECT river_job_id, run_id, state, started, reason FROM unitvisor.river_runs(%s, %s, %s)",
                            (fence.host_id, fence.epoch, list(job_ids))).fetchall()
    return {row[0]: river.LinkedRun(str(row[1]), row[2], row[3], row[4]) for row in rows}


def finish_river_job(conn: Connection, schema: str, job_id: int, attempt: int, state: river.Finish,
                     error: dict[str, Any] | None) -> bool:
    """Finish a held River job in `state` with `error` appended to its errors (None: none), as River's
    completer does: only while it is still running, and (stricter than River) still at the attempt this
    host claimed, so that a job River's rescuer took back and another client claimed again is left
    alone. False: it was not (it is someone else's now, or was finished already)."""
    return conn.execute(sql.SQL("""
        UPDATE {job} j SET state = %s::text::{state}, finalized_at = now(),
            errors = CASE WHEN %s::jsonb IS NULL THEN j.errors ELSE array_append(j.errors, %s::jsonb) END
        WHERE j.id = %s AND j.state = 'running' AND j.attempt = %s""").format(
            job=_river(schema, "river_job"), state=_river(schema, "river_job_state")),
        (state.value, Jsonb(error) if error else None, Jsonb(error) if error else None, job_id, attempt)).rowcount == 1


def cancel_river_run(conn: Connection, fence: Fence, job_id: int) -> Transition:
    """Cancel the run made from a River job (unitvisor.cancel_river_run), as cancel_run does."""
    with _fencing():
        state, changed = conn.execute("SELECT state, changed FROM unitvisor.cancel_river_run(%s, %s, %s)",
                                      (fence.host_id, fence.epoch, job_id)).fetchone()
    return Transition(state, changed)


def listen(conn: Connection, *channels: str) -> None:
    for channel in channels:
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))


def now(conn: Connection) -> datetime:
    return conn.execute("SELECT now()").fetchone()[0]


# -- roles (sql/migrations/004_roles.sql) ------------------------------------------------------------------


@dataclass(frozen=True)
class Identity:
    """What kind of role this session has: admin, submitter, host (bound to host_id) or unbound."""

    kind: str
    host_id: str | None


def sees_every_run(conn: Connection) -> tuple[str, bool]:
    """This session's login role, and whether it reads every run. The admin and a control plane do; a
    host's role does not (row-level security, sql/014_host_reads.sql: no run pinned to another host),
    nor does a role whoami() refuses, which may see nothing at all."""
    role = conn.execute("SELECT session_user").fetchone()[0]
    try:
        kind = conn.execute("SELECT kind FROM unitvisor.whoami()").fetchone()[0]
    except psycopg.errors.InsufficientPrivilege:
        return role, False
    return role, kind in ("admin", "submitter")


def fleet_refusals(conn: Connection, run_ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, str]:
    """Why no live host accepts each of these queued runs now (unitvisor.refusals_now: fleet_refusal's
    reason, what explain_waiting records only after a run has waited two poll intervals), for any role,
    of the runs it may see; a run some live host accepts, or not queued, is left out."""
    rows = conn.execute("SELECT run_id, reason FROM unitvisor.refusals_now(%s)", (list(run_ids),)).fetchall()
    return {row[0]: row[1] for row in rows}


def whoami(conn: Connection) -> Identity:
    row = conn.execute("SELECT kind, host_id FROM unitvisor.whoami()").fetchone()
    return Identity(row[0], row[1])


def role_settings(conn: Connection) -> list[str]:
    """The session defaults set on this session's login role (ALTER ROLE ... SET), for this database or
    every database, as name=value. Any role may set them on itself, as it may change its own password
    (PostgreSQL has no privilege against either), and they apply to every later session of the role:
    `unitvisor doctor` shows them."""
    rows = conn.execute(
        """SELECT c.setting FROM pg_catalog.pg_db_role_setting s, unnest(s.setconfig) AS c(setting)
           WHERE s.setrole = (SELECT r.oid FROM pg_catalog.pg_roles r WHERE r.rolname = session_user)
             AND s.setdatabase IN (0, (SELECT d.oid FROM pg_catalog.pg_database d
                                       WHERE d.datname = current_database()))
           ORDER BY 1""").fetchall()
    return [row[0] for row in rows]


def public_may_connect(conn: Connection) -> bool:
    """Whether every role of the cluster may connect to this database (PUBLIC holds CONNECT, as after
    `createdb`): README, Install revokes it."""
    return conn.execute("SELECT has_database_privilege('public', current_database(), 'CONNECT')").fetchone()[0]


_ROLE_NAME_UNSAFE = re.compile(r"[^a-z0-9_]+")
_MAX_ROLE_NAME = 63  # PostgreSQL's NAMEDATALEN - 1, in bytes; the names made here are ASCII


def default_host_role_name(host_id: str) -> str:
    """unitvisor_host_<host id>, lowercase, anything but [a-z0-9_] as one _, so that it needs no quoting
    in psql or pg_hba.conf. Cut to PostgreSQL's 63 bytes with a hash of the id at the end when longer,
    so that two long ids do not end up as one role."""
    name = "unitvisor_host_" + _ROLE_NAME_UNSAFE.sub("_", host_id.lower()).strip("_")
    if len(name) > _MAX_ROLE_NAME:
        digest = format(uuid.uuid5(uuid.NAMESPACE_OID, host_id).int & 0xFFFF_FFFF, "08x")
        name = f"{name[:_MAX_ROLE_NAME - 9]}_{digest}"
    return name


def _scram(conn: Connection, role: str, password: str) -> str:
    """The password as a SCRAM-SHA-256 verifier, made by libpq on this side: the server, its statement
    log and pg_stat_activity never see the password itself. (PQencryptPasswordConn: psycopg 3.1 too.)"""
    return conn.pgconn.encrypt_password(password.encode(), role.encode(), b"scram-sha-256").decode()


class AlreadyBound(DatabaseError):
    """The host id has a role already (or the role name is taken)."""


# How many sessions a host's login role may hold at once (CREATE ROLE ... CONNECTION LIMIT), so that one
# leaked host DSN cannot take the server's max_connections from the whole fleet. A host needs: 1 for its
# daemon (the main loop's one connection: the output-tails thread only reads the journal and hands the
# tails to the loop, metrics are served from the loop's figures, the guard thread uses D-Bus only), up to
# 2 more for a moment after the network dropped the daemon's session, which the server ends only after
# its keepalives or idle_session_timeout (host_dead_after) while the daemon has reconnected already (it
# registers only once that session's host lock is gone, so a third such session adds nothing), and 2 for
# commands run with the host's DSN beside it (`unitvisor doctor`, `wait`, `runs`). A limit reached makes
# a new session fail with "too many connections for role", never an existing one; `hosts add
# --connection-limit N` chooses another, `ALTER ROLE ... CONNECTION LIMIT -1` lifts it.
DEFAULT_HOST_CONNECTION_LIMIT = 5


def add_host_role(conn: Connection, host_id: str, role: str, password: str,
                  connection_limit: int = DEFAULT_HOST_CONNECTION_LIMIT, river: bool = False) -> None:
    """Create the login role `role` with this password and connection limit, a member of unitvisor_host
    (and of unitvisor_river when `river`: its daemon serves a River source, which creates runs), bound to
    host_id, in one transaction. Needs unitvisor_admin and the right to create roles."""
    with conn.transaction():
        bound = conn.execute("SELECT role_name FROM unitvisor.host_roles WHERE host_id = %s FOR UPDATE",
                             (host_id,)).fetchone()
        if bound is not None:
            raise AlreadyBound(f"host id {host_id} is bound to role {bound[0]} already "
                               "(--new-password gives that role a new password)")
        # CREATE ROLE takes no parameters: the name is an Identifier, the password a quoted literal of
        # its SCRAM verifier, never the password.
        try:
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN CONNECTION LIMIT {} PASSWORD {} IN ROLE {}").format(
                sql.Identifier(role), sql.Literal(int(connection_limit)), sql.Literal(_scram(conn, role, password)),
                sql.SQL(", ").join(sql.Identifier(r) for r in ([HOST_ROLE, RIVER_ROLE] if river else [HOST_ROLE]))))
        except psycopg.errors.DuplicateObject:
            raise AlreadyBound(f"role {role} exists already; choose another name with --role") from None
        try:
            conn.execute("INSERT INTO unitvisor.host_roles (role_name, host_id) VALUES (%s, %s)", (role, host_id))
        except psycopg.errors.UniqueViolation:
            raise AlreadyBound(f"role {role} is bound to another host id already") from None


def set_host_role_password(conn: Connection, host_id: str, password: str,
                           connection_limit: int | None = None) -> str | None:
    """Give the role bound to host_id a new password (and this connection limit, unless None); returns its
    name (None: no role is bound to it)."""
    with conn.transaction():
        bound = conn.execute("SELECT role_name FROM unitvisor.host_roles WHERE host_id = %s FOR UPDATE",
                             (host_id,)).fetchone()
        if bound is None:
            return None
        conn.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(
            sql.Identifier(bound[0]), sql.Literal(_scram(conn, bound[0], password))))
        if connection_limit is not None:
            conn.execute(sql.SQL("ALTER ROLE {} CONNECTION LIMIT {}").format(
                sql.Identifier(bound[0]), sql.Literal(int(connection_limit))))
    return bound[0]


def dsn_for_role(dsn: str, role: str, password: str, db_host: str | None = None) -> str:
    """The DSN a host logs in with: this DSN's server, port, database and options, with the role and
    its password instead of ours (and db_host instead of our host when given, e.g. when we came in over
    the local socket)."""
    params = {key: value for key, value in conninfo_to_dict(dsn).items() if key not in ("user", "password", "passfile")}
    if db_host:
        params["host"] = db_host
        params.pop("hostaddr", None)
    return make_conninfo(**params, user=role, password=password)

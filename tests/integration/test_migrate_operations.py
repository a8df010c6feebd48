"""`unitvisor migrate` as an operator runs it on a database in use (issue 21, "Operations that cannot
complete"): a statement longer than the daemons' statement_timeout, a second migrate at the same time,
constraints added NOT VALID and validated afterwards, indexes built CONCURRENTLY beforehand.

The million-run migration is tests/integration/test_migrate_big.py."""

from __future__ import annotations

import re
import shutil
import threading
import time
from pathlib import Path

import psycopg
import pytest

from supervisor import store
from tests.harness.host import REPO

# The released schema 001 to 012, as the catalog shows it after `migrate` (constraints with their
# definitions and whether they are validated; indexes with theirs; the owner of each table), written
# from the migrations before 005 to 008 added their constraints NOT VALID and 008 its indexes IF NOT
# EXISTS: those edits must leave the schema exactly as it was.
RELEASED_SCHEMA = Path(__file__).resolve().parent / "data" / "schema_001_012.txt"
RELEASED = [path.stem for path in sorted(store.MIGRATIONS_DIR.glob("*.sql")) if int(path.name[:3]) <= 12]
README = REPO / "README.md"


def schema_snapshot(conn: psycopg.Connection) -> str:
    """The constraints and indexes of every table of the unitvisor schema, one per line, sorted."""
    constraints = conn.execute("""
        SELECT format('constraint %s.%s %s validated=%s deferrable=%s', t.relname, c.conname,
                      pg_get_constraintdef(c.oid), c.convalidated, c.condeferrable)
        FROM pg_constraint c JOIN pg_class t ON t.oid = c.conrelid
        WHERE t.relnamespace = 'unitvisor'::regnamespace""").fetchall()
    indexes = conn.execute("""
        SELECT format('index %s valid=%s ready=%s owner=%s', pg_get_indexdef(i.indexrelid), i.indisvalid,
                      i.indisready, pg_get_userbyid(c.relowner))
        FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
        WHERE c.relnamespace = 'unitvisor'::regnamespace""").fetchall()
    return "\n".join(sorted(row[0] for row in constraints + indexes)) + "\n"


def sql_dir_up_to(tmp_path: Path, last: int) -> Path:
    """A migrations directory with the repository's migrations 001 to `last`."""
    target = tmp_path / f"sql_up_to_{last:03d}"
    target.mkdir()
    for path in sorted(store.MIGRATIONS_DIR.glob("*.sql")):
        if int(path.name[:3]) <= last:
            shutil.copy(path, target / path.name)
    return target


def readme_prebuilt_index_statements() -> list[str]:
    """The statements README's Upgrade section tells an operator to run before `migrate` on a big
    database: the block of SQL right after the line that names them."""
    text = README.read_text()
    match = re.search(r"<!-- prebuilt-indexes -->\s*```sql\n(.*?)```", text, re.S)
    assert match, "README.md: no ```sql block after <!-- prebuilt-indexes -->"
    return [s.strip() for s in match.group(1).split(";") if s.strip() and not s.strip().startswith("--")]


def test_the_released_schema_is_unchanged(empty_dsn: str, tmp_path: Path) -> None:
    """Editing released migrations is safe only if the schema they make is the one they made: a database
    that applied them before is never migrated again (its versions are recorded), and one migrated
    afresh must end where it would have."""
    with store.connect(empty_dsn) as conn:
        assert store.migrate(conn, sql_dir_up_to(tmp_path, 12)) == RELEASED
        assert store.unvalidated_constraints(conn) == []
        assert schema_snapshot(conn) == RELEASED_SCHEMA.read_text()


def test_a_migration_longer_than_the_statement_timeout_completes_and_a_second_migrate_waits(
        empty_dsn: str, tmp_path: Path) -> None:
    """One statement of 16 s, past the daemons' 15 s statement_timeout (the scan of 005 on a big
    database); a second migrate started meanwhile waits for the first, past the daemons' 5 s
    lock_timeout, and then finds nothing left to do. Before: the first failed on the statement timeout,
    the second on the lock timeout."""
    sql_dir = tmp_path / "sql"
    sql_dir.mkdir()
    shutil.copy(store.MIGRATIONS_DIR / "001_schema.sql", sql_dir / "001_schema.sql")
    (sql_dir / "002_slow.sql").write_text("SELECT pg_sleep(16);\n")
    results: dict[str, list[str]] = {}
    errors: list[BaseException] = []
    waits: list[str] = []

    def worker(name: str) -> None:
        try:
            with store.connect(empty_dsn) as conn:
                results[name] = store.migrate(conn, sql_dir, on_wait=waits.append)
                # Its own session only, and only while it ran: the daemons' limits are back.
                settings = conn.execute("SELECT current_setting('statement_timeout'), "
                                        "current_setting('lock_timeout')").fetchone()
                assert settings == (store.SESSION_SETTINGS["statement_timeout"], store.SESSION_SETTINGS["lock_timeout"])
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    first = threading.Thread(target=worker, args=("first",))
    first.start()
    with store.connect(empty_dsn) as watcher:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not watcher.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep(16)%'").fetchone()[0]:
            time.sleep(0.05)
        holder = watcher.execute("SELECT pid FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep(16)%'").fetchone()
    assert holder, "the first migrate never reached its slow migration"
    second = threading.Thread(target=worker, args=("second",))
    second.start()
    first.join(timeout=60)
    second.join(timeout=60)

    assert not errors, errors
    assert results == {"first": ["001_schema", "002_slow"], "second": []}
    assert waits == [f"another migrate is running (server pid {holder[0]}): waiting for it to end"]
    with store.connect(empty_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'").fetchone()[0] == 0


def test_a_migration_that_waits_for_a_table_lock_is_tried_again(empty_dsn: str, tmp_path: Path) -> None:
    """A table lock held past lock_timeout (a long transaction of a control plane): the migration does
    not wait on, queueing every writer of the table behind it; it is rolled back and tried again, and
    applies once the lock is gone."""
    sql_dir = sql_dir_up_to(tmp_path, 1)
    with store.connect(empty_dsn) as conn:
        store.migrate(conn, sql_dir)
    (sql_dir / "002_touch_runs.sql").write_text("ALTER TABLE unitvisor.runs ADD COLUMN note text;\n")
    with store.connect(empty_dsn) as blocker, store.connect(empty_dsn) as conn:
        blocker.execute("BEGIN")
        blocker.execute("LOCK TABLE unitvisor.runs IN ACCESS SHARE MODE")
        release = threading.Timer(7, blocker.execute, args=("COMMIT",))
        release.start()
        try:
            assert store.migrate(conn, sql_dir) == ["002_touch_runs"]
        finally:
            release.join()


def test_a_migration_chosen_to_end_a_deadlock_is_tried_again(empty_dsn: str, tmp_path: Path) -> None:
    """A migration that locks two tables, and a session that takes them in the other order: the
    server ends the deadlock by rolling one of them back; when it is the migration, it is tried again
    and applies. Before, `unitvisor migrate` failed with "deadlock detected" (test_migrate_big in CI,
    036 and a submit)."""
    sql_dir = sql_dir_up_to(tmp_path, 1)
    with store.connect(empty_dsn) as conn:
        store.migrate(conn, sql_dir)
    (sql_dir / "002_two_tables.sql").write_text("ALTER TABLE unitvisor.hosts ADD COLUMN note text;\n"
                                                "SELECT pg_sleep(2);\n"
                                                "ALTER TABLE unitvisor.runs ADD COLUMN note text;\n")
    with store.connect(empty_dsn) as other, store.connect(empty_dsn) as conn:
        other.execute("SET deadlock_timeout = '30s'")  # so that the migration's check finds the cycle
        other.execute("BEGIN")
        other.execute("LOCK TABLE unitvisor.runs IN ACCESS SHARE MODE")

        def the_other_order() -> None:
            time.sleep(1)  # the migration holds hosts and sleeps
            other.execute("LOCK TABLE unitvisor.hosts IN ACCESS SHARE MODE")  # granted once it is rolled back
            other.execute("COMMIT")

        second = threading.Thread(target=the_other_order)
        second.start()
        try:
            assert store.migrate(conn, sql_dir) == ["002_two_tables"]
        finally:
            second.join()
        assert conn.execute("SELECT count(*) FROM pg_attribute WHERE attname = 'note' AND attrelid IN "
                            "('unitvisor.hosts'::regclass, 'unitvisor.runs'::regclass)").fetchone()[0] == 2


def test_a_constraint_left_not_valid_is_validated_by_the_next_migrate(dsn: str) -> None:
    """A validation cut short (Ctrl-C, a crash) is finished by the next migrate, even with nothing left
    to apply; a row that violates it is named, and the constraint stays, enforced on new rows."""
    # runs_state_valid: a CHECK of runs that every schema has (since 022 the arguments' checks are a trigger).
    state_check = ("ALTER TABLE unitvisor.runs ADD CONSTRAINT runs_state_valid CHECK (state IN ('queued', 'starting', "
                   "'running', 'succeeded', 'failed', 'cancelled', 'expired')) NOT VALID")
    with store.connect(dsn) as conn:
        conn.execute("ALTER TABLE unitvisor.runs DROP CONSTRAINT runs_state_valid")
        conn.execute(state_check)
        assert store.unvalidated_constraints(conn) == [("runs", "runs_state_valid", store.ADMIN_ROLE)]
        assert store.migrate(conn) == []
        assert store.unvalidated_constraints(conn) == []

        conn.execute("ALTER TABLE unitvisor.runs DROP CONSTRAINT runs_state_valid")
        conn.execute("SELECT unitvisor.submit_run(ARRAY['/bin/true'])")
        conn.execute("UPDATE unitvisor.runs SET state = 'bogus'")
        conn.execute(state_check)
        with pytest.raises(store.DatabaseError, match="constraint runs_state_valid of unitvisor.runs: a row"):
            store.migrate(conn)
        assert store.unvalidated_constraints(conn) == [("runs", "runs_state_valid", store.ADMIN_ROLE)]


def test_008_takes_the_indexes_an_operator_built_concurrently_beforehand(empty_dsn: str, tmp_path: Path) -> None:
    """README's statements, run before `migrate` on a database at 007, build 008's indexes without
    blocking writes; 008 then takes them as they are (same objects) and the schema is the released one.
    Before: 008's plain CREATE INDEX failed on the name taken."""
    with store.connect(empty_dsn) as conn:
        store.migrate(conn, sql_dir_up_to(tmp_path, 7))
        for statement in readme_prebuilt_index_statements():
            conn.execute(statement)
        built = dict(conn.execute("SELECT relname, oid FROM pg_class WHERE relname IN "
                                  "('runs_finished_idx', 'spawn_jobs_run_idx', 'spawn_jobs_done_idx')").fetchall())
        assert len(built) == 3
        assert store.migrate(conn, sql_dir_up_to(tmp_path, 12)) == RELEASED[7:]
        assert dict(conn.execute("SELECT relname, oid FROM pg_class WHERE relname = ANY(%s)",
                                 (list(built),)).fetchall()) == built
        assert schema_snapshot(conn) == RELEASED_SCHEMA.read_text()


def test_043_refuses_an_invalid_index_left_by_a_failed_concurrent_build(empty_dsn: str, tmp_path: Path) -> None:
    """README's statement for 043 on a big database, built CONCURRENTLY beforehand: taken as it is when it
    is valid; an invalid one (a build that failed) is refused by name, as 008 does."""
    with store.connect(empty_dsn) as conn:
        store.migrate(conn, sql_dir_up_to(tmp_path, 42))
        conn.execute("SELECT unitvisor.submit_run(ARRAY['/bin/true']) FROM generate_series(1, 2)")
        # Two events of the same state: a unique build over it fails, as a build cut short would.
        with pytest.raises(psycopg.errors.UniqueViolation):
            conn.execute("CREATE UNIQUE INDEX CONCURRENTLY run_events_change_idx ON unitvisor.run_events (state)")
        with pytest.raises(psycopg.Error, match=r"(?s)run_events_change_idx is invalid.*DROP INDEX CONCURRENTLY"):
            store.migrate(conn)
        conn.execute("DROP INDEX CONCURRENTLY unitvisor.run_events_change_idx")
        [statement] = re.findall(r"CREATE INDEX CONCURRENTLY IF NOT EXISTS run_events_change_idx [^\n]*;",
                                 README.read_text())
        conn.execute(statement)
        built = conn.execute("SELECT 'unitvisor.run_events_change_idx'::regclass::oid").fetchone()[0]
        assert store.migrate(conn)[0] == "043_marks_leave_out_explanations"
        assert conn.execute("SELECT 'unitvisor.run_events_change_idx'::regclass::oid").fetchone()[0] == built


def test_008_refuses_an_invalid_index_left_by_a_failed_concurrent_build(empty_dsn: str, tmp_path: Path) -> None:
    """A CREATE INDEX CONCURRENTLY that failed leaves an invalid index of that name, which IF NOT
    EXISTS alone would take (and the planner never use): 008 refuses it and says what to do."""
    with store.connect(empty_dsn) as conn:
        store.migrate(conn, sql_dir_up_to(tmp_path, 7))
        run_id = conn.execute("SELECT unitvisor.submit_run(ARRAY['/bin/true'])").fetchone()[0]
        conn.execute("INSERT INTO unitvisor.spawn_jobs (run_id, state, claimed_by, claimed_at) "
                     "VALUES (%s, 'discarded', 'h1', now())", (run_id,))
        # Two jobs of one run: a unique build fails, as a concurrent build cut short by an error would.
        with pytest.raises(psycopg.errors.UniqueViolation):
            conn.execute("CREATE UNIQUE INDEX CONCURRENTLY spawn_jobs_run_idx ON unitvisor.spawn_jobs (run_id)")
        released = sql_dir_up_to(tmp_path, 12)
        with pytest.raises(psycopg.Error, match=r"(?s)spawn_jobs_run_idx is invalid.*DROP INDEX CONCURRENTLY"):
            store.migrate(conn, released)
        assert store.pending_migrations(conn, released) == RELEASED[7:]
        # Done as the message says, migrate goes through.
        conn.execute("DROP INDEX CONCURRENTLY unitvisor.spawn_jobs_run_idx")
        assert store.migrate(conn, released) == RELEASED[7:]

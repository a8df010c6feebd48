"""store.migrate and `unitvisor migrate` on brand-new, empty databases."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import psycopg
import pytest

from supervisor import store
from tests.integration.conftest import table_exists

SCHEMA_TABLES = ("unitvisor.runs", "unitvisor.attempts", "unitvisor.spawn_jobs", "unitvisor.hosts",
                 "unitvisor.run_events", "unitvisor.schema_migrations")
ALL_VERSIONS = [path.stem for path in sorted(store.MIGRATIONS_DIR.glob("*.sql"))]


def versions(conn: psycopg.Connection) -> list[str]:
    return [row[0] for row in conn.execute("SELECT version FROM unitvisor.schema_migrations ORDER BY version")]


def test_the_repository_has_the_first_migration() -> None:
    assert ALL_VERSIONS[0] == "001_schema"
    assert [v for v, _ in store.migration_files()] == ALL_VERSIONS


def test_migrate_applies_the_schema_to_an_empty_database_once(empty_dsn: str) -> None:
    with store.connect(empty_dsn) as conn:
        assert not table_exists(conn, "unitvisor.runs")
        assert store.applied_migrations(conn) == set()
        assert store.pending_migrations(conn) == ALL_VERSIONS

        assert store.migrate(conn) == ALL_VERSIONS

        for table in SCHEMA_TABLES:
            assert table_exists(conn, table), table
        assert versions(conn) == ALL_VERSIONS
        assert store.applied_migrations(conn) == set(ALL_VERSIONS)
        assert store.pending_migrations(conn) == []
        applied_at = conn.execute("SELECT applied_at FROM unitvisor.schema_migrations").fetchall()
        assert all(row[0] is not None for row in applied_at)

        # A second run applies nothing and leaves the bookkeeping as it was.
        assert store.migrate(conn) == []
        assert versions(conn) == ALL_VERSIONS
        assert store.pending_migrations(conn) == []
        # The migrated schema works: the submit function exists and runs.
        run_id = store.submit_run(conn, argv=["/bin/true"])
        assert store.get_run(conn, run_id).state == "queued"
        # The advisory lock was released.
        held = conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'").fetchone()[0]
        assert held == 0


def test_concurrent_migrations_apply_the_schema_exactly_once(empty_dsn: str) -> None:
    """Two hosts migrating at once: the advisory lock makes the second wait, then find nothing to do."""
    results: dict[int, list[str]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def worker(index: int) -> None:
        try:
            with store.connect(empty_dsn) as conn:
                barrier.wait(timeout=10)
                results[index] = store.migrate(conn)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    with store.connect(empty_dsn) as holder:
        # Hold the migration lock so that both workers are certainly inside migrate() at the same time.
        holder.execute("SELECT pg_advisory_lock(%s)", (store.MIGRATION_LOCK_KEY,))
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 20
        waiting = 0
        while time.monotonic() < deadline:
            waiting = holder.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted").fetchone()[0]
            if waiting == 2 or errors:
                break
            time.sleep(0.05)
        holder.execute("SELECT pg_advisory_unlock(%s)", (store.MIGRATION_LOCK_KEY,))
        for thread in threads:
            thread.join(timeout=60)
        assert waiting == 2, "both migrate() calls should have waited on the advisory lock"

    assert not errors, errors
    assert sorted(results.values(), key=len) == [[], ALL_VERSIONS]
    with store.connect(empty_dsn) as conn:
        assert versions(conn) == ALL_VERSIONS
        assert store.pending_migrations(conn) == []
        functions = conn.execute(
            "SELECT count(*) FROM pg_proc WHERE proname = 'submit_run' "
            "AND pronamespace = 'unitvisor'::regnamespace").fetchone()[0]
        assert functions == 1


@pytest.mark.parametrize("bad_name", ["1_short.sql", "001-dash.sql", "001_Upper.sql", "schema.sql", "001_.sql"])
def test_a_malformed_migration_file_name_is_refused(empty_dsn: str, tmp_path: Path, bad_name: str) -> None:
    shutil.copy(store.MIGRATIONS_DIR / "001_schema.sql", tmp_path / "001_schema.sql")
    (tmp_path / bad_name).write_text("SELECT 1;\n")
    with store.connect(empty_dsn) as conn:
        with pytest.raises(store.DatabaseError, match="NNN_name.sql"):
            store.migration_files(tmp_path)
        with pytest.raises(store.DatabaseError, match="NNN_name.sql"):
            store.migrate(conn, tmp_path)
        with pytest.raises(store.DatabaseError):
            store.pending_migrations(conn, tmp_path)
        # Refused before anything ran: not even the schema was created, and no lock is left behind.
        assert conn.execute("SELECT to_regnamespace('unitvisor') IS NULL").fetchone()[0]
        assert conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'").fetchone()[0] == 0


def test_migrations_apply_in_order_and_a_failing_one_is_rolled_back(empty_dsn: str, tmp_path: Path) -> None:
    shutil.copy(store.MIGRATIONS_DIR / "001_schema.sql", tmp_path / "001_schema.sql")
    # 002 depends on 001, so it only works if applied after it.
    (tmp_path / "002_extra.sql").write_text("ALTER TABLE unitvisor.runs ADD COLUMN note text;\n")
    with store.connect(empty_dsn) as conn:
        assert store.pending_migrations(conn, tmp_path) == ["001_schema", "002_extra"]
        assert store.migrate(conn, tmp_path) == ["001_schema", "002_extra"]
        assert store.pending_migrations(conn, tmp_path) == []

        (tmp_path / "003_broken.sql").write_text(
            "CREATE TABLE unitvisor.half_done (x int);\nSELECT no_such_function();\n")
        with pytest.raises(psycopg.Error):
            store.migrate(conn, tmp_path)
        # The failed file left nothing behind and is still pending; the lock was released.
        assert not table_exists(conn, "unitvisor.half_done")
        assert versions(conn) == ["001_schema", "002_extra"]
        assert store.pending_migrations(conn, tmp_path) == ["003_broken"]
        assert conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'").fetchone()[0] == 0


def test_cli_migrate_applies_then_reports_current(empty_dsn: str, cli) -> None:
    first = cli("--dsn", empty_dsn, "migrate")
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == f"applied: {', '.join(ALL_VERSIONS)}"
    assert first.stderr == ""

    second = cli("--dsn", empty_dsn, "migrate")
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == "schema is current; nothing to apply"
    assert second.stderr == ""

    with store.connect(empty_dsn) as conn:
        assert versions(conn) == ALL_VERSIONS


def test_a_schema_newer_than_this_code_is_fine_and_an_older_one_names_what_is_missing(conn) -> None:
    """Rule 4 of the migration rules in store.py: a daemon needs its own migrations, not every one."""
    conn.execute("INSERT INTO unitvisor.schema_migrations (version) VALUES ('999_from_the_future')")
    conn.execute("ALTER TABLE unitvisor.runs ADD COLUMN from_the_future text DEFAULT 'x'")
    assert store.pending_migrations(conn) == []
    run_id = store.submit_run(conn, argv=["/bin/true"])
    assert store.get_run(conn, run_id).argv == ["/bin/true"]  # the unknown column is not read
    conn.execute("DELETE FROM unitvisor.schema_migrations WHERE version = %s", (ALL_VERSIONS[-1],))
    assert store.pending_migrations(conn) == [ALL_VERSIONS[-1]]

"""Where the migrations are found (sql/migrations/, beside sql/schema.sql), and that finding none is an
error, never "schema is current"."""

from __future__ import annotations

from pathlib import Path
from unittest.mock import MagicMock

import pytest
from click.testing import CliRunner

from supervisor import cli, doctor, store

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def nowhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """An installation without migrations: neither place store.py looks holds a migrations/ with a .sql
    file (a schema.sql alone, or a migration left at the top level, is not one)."""
    wheel, beside = tmp_path / "site" / "supervisor" / "sql", tmp_path / "share" / "sql"
    (wheel / "migrations").mkdir(parents=True)
    (wheel / "migrations" / "README").write_text("not a migration\n")
    beside.mkdir(parents=True)
    (beside / "schema.sql").write_text("SELECT 1;\n")
    (beside / "001_schema.sql").write_text("SELECT 1;\n")
    monkeypatch.setattr(store, "SQL_DIRS", (wheel, beside))
    return wheel, beside


def test_a_checkout_finds_the_top_level_sql_directory() -> None:
    assert store.SQL_ROOT == REPO / "sql"
    assert store.MIGRATIONS_DIR == store.SQL_DIR == REPO / "sql" / "migrations"
    assert store.SCHEMA_FILE == REPO / "sql" / "schema.sql"
    assert [v for v, _ in store.migration_files()][:2] == ["001_schema", "002_fleet"]


def test_sql_holds_only_schema_sql_and_the_migrations_directory() -> None:
    """A migration merged from a branch written before the move lands in sql/ itself, where the loader
    never looks: it would be skipped silently. git mv it to sql/migrations/ (and fold it into
    sql/schema.sql: tests/integration/test_schema_file.py says what differs)."""
    assert store.stray_migrations(REPO / "sql") == []
    assert sorted(p.name for p in (REPO / "sql").iterdir()) == ["migrations", "schema.sql"]


def test_a_stray_migration_is_found(tmp_path: Path) -> None:
    (tmp_path / "019_new.sql").write_text("SELECT 1;\n")
    (tmp_path / "schema.sql").write_text("SELECT 1;\n")
    assert store.stray_migrations(tmp_path) == [tmp_path / "019_new.sql"]


def test_the_package_directory_comes_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheel, beside = tmp_path / "supervisor" / "sql", tmp_path / "sql"
    for d in (wheel, beside):
        (d / "migrations").mkdir(parents=True)
    (wheel / "migrations" / "001_schema.sql").write_text("SELECT 1;\n")
    (beside / "migrations" / "001_schema.sql").write_text("SELECT 2;\n")
    monkeypatch.setattr(store, "SQL_DIRS", (wheel, beside))
    assert store.migration_files() == [("001_schema", wheel / "migrations" / "001_schema.sql")]
    # An empty first candidate (a stray directory) does not hide the second.
    (wheel / "migrations" / "001_schema.sql").unlink()
    assert store.migration_files() == [("001_schema", beside / "migrations" / "001_schema.sql")]


def test_no_migration_files_is_an_error_naming_where_it_looked(nowhere: tuple[Path, Path]) -> None:
    with pytest.raises(store.DatabaseError) as caught:
        store.migration_files()
    message = str(caught.value)
    assert "\n" not in message
    assert all(str(d / "migrations") in message for d in nowhere), message


def test_migrate_with_no_files_fails_before_touching_the_database(nowhere: tuple[Path, Path]) -> None:
    conn = MagicMock()
    with pytest.raises(store.DatabaseError, match="no migration files"):
        store.migrate(conn)
    with pytest.raises(store.DatabaseError, match="no migration files"):
        store.pending_migrations(conn)
    conn.execute.assert_not_called()


def test_an_explicit_empty_directory_is_an_error_too(tmp_path: Path) -> None:
    with pytest.raises(store.DatabaseError, match=f"no migration files .* in {tmp_path}:"):
        store.migration_files(tmp_path)


def test_the_migrate_command_exits_1_with_one_line(nowhere: tuple[Path, Path],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store, "connect", lambda *a, **k: MagicMock())
    result = CliRunner().invoke(cli.cli, ["--dsn", "postgresql://nowhere/x", "migrate"])
    assert result.exit_code == 1, result.output
    assert "schema is current" not in result.output
    assert "no migration files" in result.output and str(nowhere[1] / "migrations") in result.output


def test_doctor_fails_the_database_check(nowhere: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
                                         tmp_path: Path) -> None:
    monkeypatch.setattr(store, "connect", lambda *a, **k: MagicMock())
    config = tmp_path / "unitvisor.toml"
    config.write_text("")
    checks = doctor._database_checks(doctor.config.load(config), "postgresql://nowhere/x")
    assert [(c.status, "no migration files" in c.message) for c in checks] == [("fail", True)]

"""sql/schema.sql is the whole current schema: a database made from it has the same catalog as one made
by every migration in sql/migrations/, and `unitvisor migrate` makes a new database from it.

The catalogs are compared as pg_dump --schema-only prints them (tables and their columns in order,
constraints, indexes, sequences, functions with their bodies, triggers, policies, owners, grants and
default privileges), object by object, so that a failure names each object that differs and shows how.
After adding migration NNN: make the same change in sql/schema.sql and add NNN's name to the list at
its end; this test then says what is still missing or different.
"""

from __future__ import annotations

import difflib
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest

from supervisor import store
from tests.conftest import throwaway_database
from tests.harness.postgres import Postgres, find_bindir

REPO = Path(__file__).resolve().parents[2]
SCHEMA_FILE = REPO / "sql" / "schema.sql"
MIGRATIONS_DIR = REPO / "sql" / "migrations"
ALL_VERSIONS = [path.stem for path in sorted(MIGRATIONS_DIR.glob("*.sql"))]
_HEADER = re.compile(r"^-- Name: (?P<name>.*?); Type: (?P<type>.*?); Schema: (?P<schema>.*?); Owner: (?P<owner>.*)$")


def dump_objects(postgres: Postgres, dsn: str) -> dict[str, str]:
    """pg_dump --schema-only of the database, as {"<type> <name> (owner <owner>)": its statements}.

    Normalised where two equal schemas may print differently: the random \\restrict key of newer
    pg_dump releases, and the order of the GRANTs of one object (an ACL's order is the order its grants
    were made in, which means nothing)."""
    dbname = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    result = subprocess.run([str(find_bindir() / "pg_dump"), "--schema-only", "-h", "127.0.0.1",
                             "-p", str(postgres.port), "-U", "postgres", dbname],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    objects: dict[str, list[str]] = {}
    current = "(preamble)"
    for line in result.stdout.splitlines():
        if line.startswith(("\\restrict", "\\unrestrict")):
            continue
        match = _HEADER.match(line)
        if match:
            current = f"{match['type']} {match['name']} (owner {match['owner']})"
            assert current not in objects, f"pg_dump printed {current} twice"
            objects[current] = []
        elif line and line != "--":
            objects.setdefault(current, []).append(line)
    normalised = {}
    for key, lines in objects.items():
        if key.startswith(("ACL ", "DEFAULT ACL ")):
            lines = sorted(lines)
        normalised[key] = "\n".join(lines) + "\n"
    return normalised


def catalog_differences(by_migrations: dict[str, str], by_schema: dict[str, str]) -> list[str]:
    """What a colleague has to change in sql/schema.sql, one entry per object."""
    out = []
    for key in sorted(by_migrations.keys() - by_schema.keys()):
        out.append(f"missing from sql/schema.sql: {key}\n{by_migrations[key]}")
    for key in sorted(by_schema.keys() - by_migrations.keys()):
        out.append(f"in sql/schema.sql but made by no migration: {key}\n{by_schema[key]}")
    for key in sorted(by_migrations.keys() & by_schema.keys()):
        if by_migrations[key] != by_schema[key]:
            diff = difflib.unified_diff(by_migrations[key].splitlines(), by_schema[key].splitlines(),
                                        "by the migrations", "by sql/schema.sql", lineterm="", n=2)
            out.append(f"differs: {key}\n" + "\n".join(diff))
    return out


def assert_same_catalog(by_migrations: dict[str, str], by_schema: dict[str, str]) -> None:
    differences = catalog_differences(by_migrations, by_schema)
    assert not differences, (
        f"{len(differences)} object(s) differ between the migrations and sql/schema.sql (pg_dump --schema-only, "
        "per object; make sql/schema.sql say what the migrations made):\n\n" + "\n\n".join(differences))


@contextmanager
def database(postgres: Postgres) -> Iterator[str]:
    with throwaway_database(postgres) as dsn:
        yield dsn


def apply_schema_file(dsn: str, path: Path = SCHEMA_FILE) -> None:
    """The file as psql -1 would apply it: one transaction, as the superuser."""
    with store.connect(dsn) as conn, conn.transaction():
        conn.execute(path.read_text())


@pytest.fixture(scope="module")
def by_migrations(postgres: Postgres) -> dict[str, str]:
    """The catalog that every migration, applied in order to an empty database, makes."""
    with database(postgres) as dsn:
        with store.connect(dsn) as conn:
            assert store.migrate(conn, from_schema=False) == ALL_VERSIONS
        return dump_objects(postgres, dsn)


def test_schema_sql_makes_what_every_migration_makes(postgres: Postgres, by_migrations: dict[str, str]) -> None:
    with database(postgres) as dsn:
        apply_schema_file(dsn)
        assert_same_catalog(by_migrations, dump_objects(postgres, dsn))
        with store.connect(dsn) as conn:
            assert store.pending_migrations(conn) == [], (
                "sql/schema.sql does not record every migration: add each name to the INSERT at its end")


def test_the_comparison_is_of_every_object(by_migrations: dict[str, str]) -> None:
    """What the comparison sees, so that it cannot pass by comparing nothing."""
    kinds = {key.split(" ", 1)[0] for key in by_migrations}
    assert {"TABLE", "INDEX", "FUNCTION", "TRIGGER", "POLICY", "SEQUENCE", "CONSTRAINT", "ACL"} <= kinds, kinds
    assert "FUNCTION submit_run(argv text[], environment jsonb, working_directory text, run_user text, " \
        in "\n".join(by_migrations)


@pytest.mark.parametrize("change", ["a function left out", "a stale body", "a column out of order", "a grant left out"])
def test_a_schema_sql_that_differs_is_named(postgres: Postgres, by_migrations: dict[str, str], tmp_path: Path,
                                            change: str) -> None:
    """The comparison fails, naming the object, on each way schema.sql can go stale."""
    text = SCHEMA_FILE.read_text()
    if change == "a function left out":
        start = text.index("CREATE FUNCTION unitvisor.notify_spawn_jobs(")
        stale = text[:start] + text[text.index("$$;", start) + 3:]
        expected = "missing from sql/schema.sql: FUNCTION notify_spawn_jobs("
    elif change == "a stale body":
        stale = text.replace("SELECT ARRAY['succeeded', 'failed', 'cancelled', 'expired', 'skipped']::text[]",
                             "SELECT ARRAY['succeeded', 'failed', 'cancelled']::text[]", 1)
        expected = "differs: FUNCTION retention_states()"
    elif change == "a column out of order":
        stale = text.replace("    memory_high         bigint,\n", "", 1).replace(
            "    private_network     boolean NOT NULL DEFAULT false,\n",
            "    memory_high         bigint,\n    private_network     boolean NOT NULL DEFAULT false,\n", 1)
        expected = "differs: TABLE runs"
    else:
        stale = text.replace("    unitvisor.expire_runs(text,bigint),\n", "", 1)
        expected = "differs: ACL FUNCTION expire_runs("
    assert stale != text, change
    (tmp_path / "schema.sql").write_text(stale)
    with database(postgres) as dsn:
        apply_schema_file(dsn, tmp_path / "schema.sql")
        differences = catalog_differences(by_migrations, dump_objects(postgres, dsn))
    assert any(d.startswith(expected) for d in differences), differences


def test_migrate_makes_a_new_database_from_schema_sql(postgres: Postgres, by_migrations: dict[str, str]) -> None:
    with database(postgres) as dsn:
        with store.connect(dsn) as conn:
            # Told apart from the history by its applied_at: one transaction, so one now() for all.
            assert store.migrate(conn) == ALL_VERSIONS
            assert conn.execute("SELECT count(DISTINCT applied_at) FROM unitvisor.schema_migrations").fetchone()[0] == 1
            assert store.migrate(conn) == []
            run_id = store.submit_run(conn, argv=["/bin/true"])
            assert store.get_run(conn, run_id).state == "queued"
        assert_same_catalog(by_migrations, dump_objects(postgres, dsn))


def _sql_tree_with_a_later_migration(tmp_path: Path) -> Path:
    """A copy of sql/ with one migration more, written as a colleague would: a column at the end of
    runs, a function replaced in place, a new one granted to the submitter."""
    root = tmp_path / "sql"
    shutil.copytree(REPO / "sql", root)
    (root / "migrations" / "999_later.sql").write_text(
        "ALTER TABLE unitvisor.runs ADD COLUMN note text;\n"
        "CREATE OR REPLACE FUNCTION unitvisor.retention_states() RETURNS text[]\n"
        "LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$\n"
        "    SELECT ARRAY['succeeded', 'failed', 'cancelled', 'expired', 'later']::text[]\n$$;\n"
        "CREATE FUNCTION unitvisor.later() RETURNS int LANGUAGE sql AS $$ SELECT 1 $$;\n"
        "GRANT EXECUTE ON FUNCTION unitvisor.later() TO unitvisor_submitter;\n")
    return root


def test_a_database_made_from_schema_sql_takes_a_later_migration(postgres: Postgres, tmp_path: Path) -> None:
    root = _sql_tree_with_a_later_migration(tmp_path)
    dumps = {}
    for from_schema in (True, False):
        with database(postgres) as dsn:
            with store.connect(dsn) as conn:
                assert store.migrate(conn, root / "migrations", from_schema=from_schema) == [*ALL_VERSIONS, "999_later"]
                # Applied as the admin, on objects the admin owns: the column and the replaced function.
                owner = conn.execute("SELECT pg_get_userbyid(proowner) FROM pg_proc WHERE oid = "
                                     "'unitvisor.later()'::regprocedure").fetchone()[0]
                assert owner == store.ADMIN_ROLE
                assert conn.execute("SELECT unitvisor.retention_states()").fetchone()[0][-1] == "later"
                assert conn.execute("SELECT note FROM unitvisor.runs LIMIT 0").description[0].name == "note"
            dumps[from_schema] = dump_objects(postgres, dsn)
    assert_same_catalog(dumps[False], dumps[True])


def test_a_schema_sql_ahead_of_its_migrations_is_refused(postgres: Postgres, tmp_path: Path) -> None:
    """An installation whose schema.sql records a migration it does not ship must not mark it applied."""
    root = tmp_path / "sql"
    shutil.copytree(REPO / "sql", root)
    last = sorted((root / "migrations").glob("*.sql"))[-1]
    last.unlink()
    with database(postgres) as dsn, store.connect(dsn) as conn:
        with pytest.raises(store.DatabaseError, match=f"records migration\\(s\\) {last.stem}, which are not"):
            store.migrate(conn, root / "migrations")
        assert store.applied_migrations(conn) == set()
        assert conn.execute("SELECT to_regclass('unitvisor.runs') IS NULL").fetchone()[0]

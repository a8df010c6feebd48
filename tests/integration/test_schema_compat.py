"""What the previous release (0.2.0, schemas 001 and 002) needs of every later schema, for a rolling
upgrade (README.md, Upgrade): it reads runs, attempts and hosts by explicit column lists, so every
column it knows must still be there with the same type; a later migration may add columns, never drop
or retype one. (0.1.0 read runs and attempts with SELECT *: it is not upgraded past 0.2.0 directly.)"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from supervisor import store

pytestmark = pytest.mark.integration

COLUMNS = """SELECT table_name, column_name, data_type FROM information_schema.columns
             WHERE table_schema = 'unitvisor' AND table_name IN ('runs', 'attempts', 'hosts', 'spawn_jobs',
                                                                 'run_events', 'run_waits')"""


def test_later_migrations_keep_every_column_the_previous_release_reads(empty_dsn: str, tmp_path: Path) -> None:
    for name in ("001_schema.sql", "002_fleet.sql"):
        shutil.copy(store.MIGRATIONS_DIR / name, tmp_path / name)
    with store.connect(empty_dsn) as conn:
        assert store.migrate(conn, tmp_path) == ["001_schema", "002_fleet"]
        released = set(conn.execute(COLUMNS).fetchall())
        assert store.migrate(conn)  # every later migration
        assert store.pending_migrations(conn) == []
        assert released <= set(conn.execute(COLUMNS).fetchall())


FUNCTIONS = """SELECT p.proname, p.proargtypes::regtype[]::text[], p.pronargdefaults,
                      pg_get_function_result(p.oid)
               FROM pg_proc p WHERE p.pronamespace = 'unitvisor'::regnamespace"""


def test_later_migrations_keep_every_function_call_of_the_previous_release(empty_dsn: str, tmp_path: Path) -> None:
    # 0.3.0 (schemas 001 to 005) calls the schema's functions by name and argument types: each must
    # still take those arguments and return the same, either the same function or one with the same
    # arguments first and only defaulted ones after them (as submit_run gains arguments).
    for path in sorted(store.MIGRATIONS_DIR.glob("00[1-5]_*.sql")):
        shutil.copy(path, tmp_path / path.name)
    with store.connect(empty_dsn) as conn:
        store.migrate(conn, tmp_path)
        released = conn.execute(FUNCTIONS).fetchall()
        store.migrate(conn)
        now = conn.execute(FUNCTIONS).fetchall()
    for name, args, _, result in released:
        assert any(other == name and later[:len(args)] == args and len(later) - len(args) <= defaults
                   and same_result == result
                   for other, later, defaults, same_result in now), f"{name}({', '.join(args)}) -> {result}"

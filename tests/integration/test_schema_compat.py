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
        shutil.copy(store.SQL_DIR / name, tmp_path / name)
    with store.connect(empty_dsn) as conn:
        assert store.migrate(conn, tmp_path) == ["001_schema", "002_fleet"]
        released = set(conn.execute(COLUMNS).fetchall())
        assert store.migrate(conn)  # every later migration
        assert store.pending_migrations(conn) == []
        assert released <= set(conn.execute(COLUMNS).fetchall())

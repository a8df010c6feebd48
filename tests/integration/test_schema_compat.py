"""What the released 0.1.0 needs of every later schema, for a rolling upgrade (README.md, Upgrade):
it reads runs and attempts with SELECT * into dataclasses that refuse a field they do not know, and
its claim statement returns r.* (a prepared plan whose result type may not change). So no migration
may add, drop or change a column of either table while a 0.1.0 may still run against it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from supervisor import store

pytestmark = pytest.mark.integration

COLUMNS = """SELECT table_name, string_agg(column_name || ' ' || data_type, ', ' ORDER BY ordinal_position)
             FROM information_schema.columns
             WHERE table_schema = 'unitvisor' AND table_name IN ('runs', 'attempts') GROUP BY table_name"""


def test_later_migrations_leave_the_tables_010_reads_with_select_star_alone(empty_dsn: str, tmp_path: Path) -> None:
    shutil.copy(store.SQL_DIR / "001_schema.sql", tmp_path / "001_schema.sql")
    with store.connect(empty_dsn) as conn:
        assert store.migrate(conn, tmp_path) == ["001_schema"]
        released = dict(conn.execute(COLUMNS).fetchall())
        assert store.migrate(conn)  # every later migration
        assert store.pending_migrations(conn) == []
        assert dict(conn.execute(COLUMNS).fetchall()) == released

"""docs/examples/graceful_stop.sql, docs/sql-api.md's example of a graceful stop, run with the real `psql`
as a unitvisor_submitter login role: its output must be docs/examples/graceful_stop.out (run ids aside),
as tests/integration/test_sql_api_example.py does for the main example. Regenerate with
UNITVISOR_REGENERATE_EXAMPLES=1."""

from __future__ import annotations

import psycopg

from tests.harness.host import REPO
from tests.harness.postgres import Postgres
from tests.integration.test_sql_api_example import assert_example_prints_its_out

EXAMPLE = REPO / "docs" / "examples" / "graceful_stop.sql"


def test_the_documented_psql_example_runs_and_prints_what_the_docs_show(postgres: Postgres,
                                                                         conn: psycopg.Connection) -> None:
    assert_example_prints_its_out(postgres, conn.info.dbname, EXAMPLE)
    assert conn.execute("SELECT state, stop_signal, warn_signal FROM unitvisor.runs").fetchall() == [
        ("cancelled", "INT", "USR1")]

"""docs/examples/graceful_stop.sql, docs/sql-api.md's example of a graceful stop, run with the real `psql`
as a unitvisor_submitter login role: its output must be docs/examples/graceful_stop.out (run ids aside),
as tests/integration/test_sql_api_example.py does for the main example. Regenerate with
UNITVISOR_REGENERATE_EXAMPLES=1."""

from __future__ import annotations

import os
import subprocess

import psycopg

from supervisor import store
from tests.harness.host import REPO
from tests.harness.postgres import Postgres
from tests.integration.conftest import TEST_SUBMITTER, ensure_login_role
from tests.integration.test_sql_api_example import normalised

EXAMPLE = REPO / "docs" / "examples" / "graceful_stop.sql"
EXAMPLE_OUT = REPO / "docs" / "examples" / "graceful_stop.out"


def test_the_documented_psql_example_runs_and_prints_what_the_docs_show(postgres: Postgres,
                                                                         conn: psycopg.Connection) -> None:
    ensure_login_role(postgres, TEST_SUBMITTER, store.SUBMITTER_ROLE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env.update(PGHOST="127.0.0.1", PGPORT=str(postgres.port), PGDATABASE=conn.info.dbname, PGUSER=TEST_SUBMITTER)
    result = subprocess.run([str(postgres.bindir / "psql"), "-X", "-f", str(EXAMPLE.relative_to(REPO))],
                            env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    actual = normalised(result.stdout) + "-- stderr:\n" + normalised(result.stderr)
    if os.environ.get("UNITVISOR_REGENERATE_EXAMPLES"):
        EXAMPLE_OUT.write_text(actual)
    assert actual == EXAMPLE_OUT.read_text()
    assert conn.execute("SELECT state, stop_signal, warn_signal FROM unitvisor.runs").fetchall() == [
        ("cancelled", "INT", "USR1")]

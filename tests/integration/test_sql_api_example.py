"""docs/examples/sql_api.sql, the SQL API's documented example, run with the real `psql` binary as a
unitvisor_submitter login role: its output must be docs/examples/sql_api.out (run ids and process ids
aside), so that the example in docs/sql-api.md cannot rot."""

from __future__ import annotations

import os
import re
import subprocess

import psycopg

from supervisor import store
from tests.harness.host import REPO
from tests.harness.postgres import Postgres
from tests.integration.conftest import TEST_SUBMITTER, ensure_login_role

SCRIPT = REPO / "docs" / "examples" / "sql_api.sql"
EXPECTED = REPO / "docs" / "examples" / "sql_api.out"
UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def run_example(postgres: Postgres, dbname: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env.update(PGHOST="127.0.0.1", PGPORT=str(postgres.port), PGDATABASE=dbname, PGUSER=TEST_SUBMITTER)
    # Relative to the repository, so that psql's "psql:<file>:<line>:" prefix is the same everywhere.
    return subprocess.run([str(postgres.bindir / "psql"), "-X", "-f", str(SCRIPT.relative_to(REPO))],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=60)


def normalised(text: str) -> str:
    text = UUID_RE.sub("<run id>", text)
    return re.sub(r"server process with PID \d+", "server process with PID <pid>", text)


def test_the_documented_psql_example_runs_and_prints_what_the_docs_show(
        postgres: Postgres, conn: psycopg.Connection) -> None:
    ensure_login_role(postgres, TEST_SUBMITTER, store.SUBMITTER_ROLE)
    result = run_example(postgres, conn.info.dbname)
    assert result.returncode == 0, result.stderr
    # stdout and stderr apart: psql writes the refusal to stderr, and the two pipes do not interleave
    # in a fixed order.
    actual = normalised(result.stdout) + "-- stderr:\n" + normalised(result.stderr)
    if os.environ.get("UNITVISOR_REGENERATE_EXAMPLES"):
        EXPECTED.write_text(actual)
    assert actual == EXPECTED.read_text()
    # And what it did is what the database holds: two runs, cancelled.
    assert conn.execute("SELECT state, labels, concurrency_key FROM unitvisor.runs ORDER BY created_at").fetchall() == [
        ("cancelled", {"team": "docs", "pipeline": "nightly"}, None), ("cancelled", {}, "db-migrate")]

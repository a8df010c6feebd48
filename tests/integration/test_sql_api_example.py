"""docs/examples/sql_api.sql, the SQL API's documented example, run with the real `psql` binary as a
unitvisor_submitter login role: its output must be docs/examples/sql_api.out (run ids and process ids
aside), so that the example in docs/sql-api.md cannot rot."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import psycopg

from supervisor import store
from tests.harness.host import REPO
from tests.harness.postgres import Postgres
from tests.integration.conftest import TEST_SUBMITTER, ensure_login_role

SCRIPT = REPO / "docs" / "examples" / "sql_api.sql"
UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def normalised(text: str) -> str:
    text = UUID_RE.sub("<run id>", text)
    return re.sub(r"server process with PID \d+", "server process with PID <pid>", text)


def assert_example_prints_its_out(postgres: Postgres, dbname: str, script: Path) -> None:
    """A docs/examples/*.sql script, run with the real psql as a unitvisor_submitter login role, prints
    the .out beside it (run ids and process ids aside); UNITVISOR_REGENERATE_EXAMPLES=1 writes the .out
    instead. Every documented example is checked by this one function."""
    ensure_login_role(postgres, TEST_SUBMITTER, store.SUBMITTER_ROLE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env.update(PGHOST="127.0.0.1", PGPORT=str(postgres.port), PGDATABASE=dbname, PGUSER=TEST_SUBMITTER)
    # Relative to the repository, so that psql's "psql:<file>:<line>:" prefix is the same everywhere.
    result = subprocess.run([str(postgres.bindir / "psql"), "-X", "-f", str(script.relative_to(REPO))],
                            env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    # stdout and stderr apart: psql writes a refusal to stderr, and the two pipes do not interleave
    # in a fixed order.
    actual = normalised(result.stdout) + "-- stderr:\n" + normalised(result.stderr)
    expected = script.with_suffix(".out")
    if os.environ.get("UNITVISOR_REGENERATE_EXAMPLES"):
        expected.write_text(actual)
    assert actual == expected.read_text()


def test_the_documented_psql_example_runs_and_prints_what_the_docs_show(
        postgres: Postgres, conn: psycopg.Connection) -> None:
    assert_example_prints_its_out(postgres, conn.info.dbname, SCRIPT)
    # And what it did is what the database holds: three runs, cancelled, the third one held and released;
    # then a chain of three, the first cancelled twice and the two below it skipped again.
    assert conn.execute("SELECT state, labels, concurrency_key, held_at, after_policy FROM unitvisor.runs "
                        "ORDER BY created_at").fetchall() == [
        ("cancelled", {"team": "docs", "pipeline": "nightly"}, None, None, None),
        ("cancelled", {}, "db-migrate", None, None), ("cancelled", {}, None, None, None),
        ("cancelled", {}, None, None, None), ("skipped", {}, None, None, "succeeded"),
        ("skipped", {}, None, None, "succeeded")]


DOC = REPO / "docs" / "sql-api.md"
SQL_DIR = REPO / "sql" / "migrations"


def test_the_doc_names_every_function_a_role_may_call_and_every_api_argument(conn: psycopg.Connection) -> None:
    """docs/sql-api.md against the migrated database: every function of the schema that a submitter or a
    host may execute, and the admin's prune, is named; every argument of those a submitter may call too."""
    doc = DOC.read_text()
    rows = conn.execute(
        """SELECT p.proname, coalesce(p.proargnames, '{}'), coalesce(p.proargmodes::text[], '{}'),
                  has_function_privilege('unitvisor_submitter', p.oid, 'EXECUTE')
           FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
           WHERE n.nspname = 'unitvisor' AND (p.proname = 'prune'
                 OR has_function_privilege('unitvisor_submitter', p.oid, 'EXECUTE')
                 OR has_function_privilege('unitvisor_host', p.oid, 'EXECUTE'))""").fetchall()
    names = {row[0] for row in rows}
    assert {"submit_run", "cancel_run", "resume_run", "run_status", "runs_with_labels", "expire_runs"} <= names
    assert [name for name in sorted(names) if f"`{name}" not in doc and f"unitvisor.{name}(" not in doc] == []
    for name, args, modes, api in rows:
        if api:  # input arguments only: a RETURNS TABLE column is an argument of mode 't'
            inputs = [a for a, m in zip(args, modes or ["i"] * len(args), strict=False) if m in ("i", "b", "v")]
            assert [a for a in inputs if not re.search(rf"\b{a}\b", doc)] == [], name


def test_the_doc_names_every_notify_channel() -> None:
    channels = {m for path in SQL_DIR.glob("*.sql")
                for m in re.findall(r"pg_notify\('([a-z_]+)'", path.read_text())}
    assert channels == {"unitvisor_run_finished", "unitvisor_spawn", "unitvisor_cancel"}
    assert [c for c in channels if f"| `{c}` |" not in DOC.read_text()] == []

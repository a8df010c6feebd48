"""`unitvisor prune`, the real executable against PostgreSQL: a dry run counts, a prune deletes the
same, in batches; a role that is not the admin is refused in one line."""

from __future__ import annotations

import json

import psycopg
from psycopg.conninfo import make_conninfo

from supervisor import store
from tests.harness.postgres import Postgres
from tests.integration.conftest import TEST_SUBMITTER, ensure_login_role, register
from tests.integration.test_cli_db import assert_one_line_error
from tests.integration.test_retention import finished_run


def test_prune_dry_run_then_prune_end_to_end(cli, dsn: str, conn: psycopg.Connection) -> None:
    fence = register(conn, "h1", max_runs=10)
    old = [finished_run(conn, fence, days) for days in (40, 41, 42)]
    young = finished_run(conn, fence, 3)

    dry = cli("prune", "--older-than", "30d", "--dry-run", "--json", dsn=dsn)
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout) == {"dry_run": True, "older_than_seconds": 30 * 86400.0, "runs": 3,
                                      "attempts": 3, "events": 12, "jobs": 3}
    assert all(store.get_run(conn, run_id) for run_id in old)

    done = cli("prune", "--older-than", "30d", "--batch-size", "2", dsn=dsn)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == ("deleted 3 run(s) finished more than 30d00h ago, with 3 attempt(s) and 12 event(s); "
                           "3 spawn job(s) in all\n")
    assert [store.get_run(conn, run_id) for run_id in old] == [None] * 3
    assert store.get_run(conn, young) is not None

    again = cli("prune", "--older-than", "30d", "--dry-run", dsn=dsn)
    assert again.stdout.startswith("would delete 0 run(s)")


def test_prune_as_a_submitter_is_refused_in_one_line(cli, dsn: str, postgres: Postgres) -> None:
    ensure_login_role(postgres, TEST_SUBMITTER, store.SUBMITTER_ROLE)
    result = cli("prune", "--older-than", "30d", dsn=make_conninfo(dsn, user=TEST_SUBMITTER))
    line = assert_one_line_error(result, 1)
    assert "the database refused `unitvisor prune` to this role" in line
    assert line.endswith("it needs unitvisor_admin: pass its DSN with --dsn-file or UNITVISOR_DSN_FILE"), line

"""One place for each argument check of a run (issue 24, schema 22): unitvisor.run_argument_problem,
which submit_run calls and the table's trigger runs_arguments_valid calls too. A run submitted and a row
written directly are refused alike, with the same error; each bound is written once in sql/schema.sql."""

from __future__ import annotations

import re
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.types.json import Jsonb

from tests.integration.conftest import assert_nothing_written
from tests.integration.test_submit import REFUSALS, call_submit

SCHEMA_FILE = Path(__file__).resolve().parents[2] / "sql" / "schema.sql"
# A case the table cannot judge: "start_deadline must be in the future" depends on now(), and only
# submit_run asks it (a row may stay queued past its deadline until it is expired).
ONLY_AT_SUBMIT = {"deadline-past"}


def insert_directly(conn: psycopg.Connection, values: dict) -> None:
    """The row a control plane with write access would insert, bypassing submit_run."""
    row = {"argv": ["/bin/true"], **values}
    for name in ("environment", "labels"):
        if name in row:
            row[name] = Jsonb(row[name])
    conn.execute(sql.SQL("INSERT INTO unitvisor.runs ({}) VALUES ({})").format(
        sql.SQL(", ").join(map(sql.Identifier, row)), sql.SQL(", ").join(sql.Placeholder() * len(row))),
        list(row.values()))


@pytest.mark.parametrize(("values", "constraint", "message"),
                         [case for case in REFUSALS if case.id not in ONLY_AT_SUBMIT])
def test_a_row_written_directly_is_refused_as_submit_run_refuses_it(conn: psycopg.Connection, values: dict,
                                                                     constraint: str, message: str) -> None:
    with pytest.raises(psycopg.errors.CheckViolation) as submitted:
        call_submit(conn, **values)
    with pytest.raises(psycopg.errors.CheckViolation) as inserted:
        insert_directly(conn, values)
    for info in (submitted, inserted):
        assert info.value.diag.constraint_name == constraint
        assert info.value.diag.message_primary.startswith(message)
        assert info.value.diag.message_detail is None  # never the row
    assert inserted.value.diag.message_primary == submitted.value.diag.message_primary
    assert inserted.value.diag.message_hint == submitted.value.diag.message_hint
    assert_nothing_written(conn)


def test_an_update_of_an_argument_is_checked_and_one_of_state_is_not_slowed(conn: psycopg.Connection) -> None:
    run_id = call_submit(conn)
    with pytest.raises(psycopg.errors.CheckViolation, match=r"^tasks_max: 0 is out of range \(1 to 4194304 tasks\)"):
        conn.execute("UPDATE unitvisor.runs SET tasks_max = 0 WHERE id = %s", (run_id,))
    # The trigger fires on the argument columns only: a state change (every claim and outcome) does not
    # pay for the checks.
    trigger = conn.execute("SELECT pg_get_triggerdef(oid) FROM pg_trigger WHERE tgname = 'runs_arguments_valid'"
                           ).fetchone()[0]
    assert "UPDATE OF argv," in trigger and " state" not in trigger.split("ON unitvisor.runs")[0]
    conn.execute("UPDATE unitvisor.runs SET state = 'cancelled', finished_at = now() WHERE id = %s", (run_id,))


@pytest.mark.parametrize("bound", ["1048576", "4611686018427387904", "4194304", "315360000", "86400", "604800",
                                   "'^[a-z_][a-z0-9_-]{0,31}$'"])
def test_each_bound_is_written_once_in_schema_sql(bound: str) -> None:
    """Before schema 22 each was written in the table's constraint and again in submit_run's checks
    (and its message): two places to change, and to disagree."""
    text = SCHEMA_FILE.read_text()
    code = "\n".join(line.split("--", 1)[0] for line in text.splitlines())  # comments may say it again
    assert len(re.findall(r"(?<![\w'])" + re.escape(bound) + r"(?![\w'])", code)) == 1, bound

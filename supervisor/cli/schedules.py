"""The command on schedules: schedules (the list). Schedules are made, paused and dropped in SQL
(unitvisor.create_schedule, pause_schedule, drop_schedule: docs/sql-api.md, Schedules), by a control plane
or psql; this shows what the database says of them, the next due time as cron_next computed it."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import click

from supervisor import store
from supervisor.cli.app import Context, cli, pass_ctx
from supervisor.cli.output import iso, print_table, state_cell


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def schedules(ctx: Context, as_json: bool) -> None:
    """List schedules: their cron expression, next and last due time, and the last run.

    NEXT is the next due time in the schedule's own time zone (PAUSED for a paused schedule, `never` when
    the expression matches no time within 10 years); LAST the latest due time a daemon reached, with
    what it did (submitted, skipped while the last run was live, missed while no daemon was up, or
    refused by submit_run) and that run's state. MISSED counts due times reached over a minute late.
    Schedules are created in SQL: `SELECT unitvisor.create_schedule(...)` (docs/sql-api.md).

    \b
    Example:
      unitvisor schedules
      unitvisor schedules --json
    """
    with ctx.connect() as conn:
        rows = store.list_schedules(conn)
    if as_json:
        click.echo(json.dumps([_schedule_json(r) for r in rows], indent=2))
        return
    if not rows:
        click.echo("no schedules (create one with SELECT unitvisor.create_schedule(...): docs/sql-api.md)")
        return
    table = [("NAME", "CRON", "TIMEZONE", "NEXT", "LAST", "LAST RUN", "OVERLAP", "CATCH-UP", "MISSED")]
    notes = []
    for r in rows:
        run = "-" if r["last_run_id"] is None else (
            f"{str(r['last_run_id'])[:8]} " + state_cell(r["last_run_state"] or "pruned"))
        last = "-" if r["last_due"] is None else f"{_local(r['last_due'], r['timezone'])} ({_brief(r['last_result'])})"
        table.append((r["name"], r["cron"], r["timezone"], _next(r), last, run, r["overlap"], r["catch_up"],
                      str(r["missed"])))
        if r["last_result"] and r["last_result"].startswith("refused"):
            notes.append(f"{r['name']}: {r['last_result']}")
    print_table(table)
    for note in notes:
        click.echo(note)


def _schedule_json(r: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": r["name"], "cron": r["cron"], "timezone": r["timezone"], "run": r["run"], "overlap": r["overlap"],
        "catch_up": r["catch_up"], "paused": r["paused"], "next_due": iso(r["next_due"]),
        "last_due": iso(r["last_due"]), "last_result": r["last_result"], "last_at": iso(r["last_at"]),
        "last_run_id": str(r["last_run_id"]) if r["last_run_id"] else None, "last_run_state": r["last_run_state"],
        "submitted": r["submitted"], "skipped": r["skipped"], "missed": r["missed"],
        "created_at": iso(r["created_at"]), "created_by": r["created_by"],
    }


def _local(when: datetime, timezone: str) -> str:
    """A time as the schedule's zone reads it, with its offset (the days clocks change show which 02:30)."""
    try:
        return when.astimezone(ZoneInfo(timezone)).strftime("%Y-%m-%d %H:%M %z")
    except (ZoneInfoNotFoundError, ValueError):  # a zone PostgreSQL knows and this machine's tzdata does not
        return iso(when) or "-"


def _next(r: dict[str, Any]) -> str:
    if r["paused"]:
        return "PAUSED"
    return "never" if r["next_due"] is None else _local(r["next_due"], r["timezone"])


def _brief(result: str | None) -> str:
    """The first word of the last result (the whole is in --json and, refused, in a note below the table)."""
    return (result or "-").split(" ", 1)[0].rstrip(":,")

"""The commands on named limits (schema 032): limits (the list, with each limit's live runs now),
limits set, limits drop. A limit caps the runs live at once across the fleet whose labels hold every
pair of its selector; the database checks every argument (unitvisor.set_limit) and the claim keeps it
(docs/sql-api.md, Concurrency limits)."""

from __future__ import annotations

import json
from typing import Any

import click

from supervisor import store
from supervisor.cli.app import Context, Failure, cli, invocation, pass_ctx
from supervisor.cli.output import iso, print_table
from supervisor.cli.params import label_pairs

_JSON_OPTION = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


def _selector_text(selector: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(selector.items())) or "(every run)"


def _limit_json(r: dict[str, Any]) -> dict[str, Any]:
    return {"name": r["name"], "selector": r["selector"], "max_live": r["max_live"], "live": r["live"],
            "full": r["live"] >= r["max_live"], "set_at": iso(r["set_at"]), "set_by": r["set_by"]}


@cli.group(invoke_without_command=True, subcommand_metavar="[COMMAND] [ARGS]...")
@_JSON_OPTION
@click.pass_context
def limits(click_ctx: click.Context, as_json: bool) -> None:
    """List named limits: each one's label selector, its maximum, and its runs live now.

    A limit lets at most MAX runs whose labels hold every pair of SELECTOR be starting or running at
    once, across all hosts; the others wait (their wait reason names the limit). LIVE at or over MAX
    is marked FULL: a limit lowered below its live count stops nothing, and no run of it starts until
    fewer than MAX are live.

    \b
    Example:
      unitvisor limits
      unitvisor limits set batch --selector team=batch --max 20
      unitvisor limits drop batch
    """
    if click_ctx.invoked_subcommand is not None:
        invocation["command"] = f"limits {click_ctx.invoked_subcommand}"
        return
    ctx: Context = click_ctx.obj
    with ctx.connect() as conn:
        rows = store.list_limits(conn)
    if as_json:
        click.echo(json.dumps([_limit_json(r) for r in rows], indent=2))
        return
    if not rows:
        click.echo("no limits (set one with `unitvisor limits set NAME --selector KEY=VALUE --max N`)")
        return
    table = [("NAME", "SELECTOR", "LIVE", "MAX", "SET", "BY")]
    for r in rows:
        live = f"{r['live']} FULL" if r["live"] >= r["max_live"] else str(r["live"])
        table.append((r["name"], _selector_text(r["selector"]), live, str(r["max_live"]), iso(r["set_at"]) or "-",
                      r["set_by"]))
    print_table(table)


@limits.command("set")
@click.argument("name")
@click.option("--selector", "selector", multiple=True, callback=label_pairs, metavar="KEY=VALUE",
              help="A label the runs of the limit carry (repeatable: all of them); none: every run.")
@click.option("--max", "max_live", type=int, required=True, metavar="N",
              help="How many of its runs may be live at once in the fleet (0 to 1000000; 0: none starts).")
@_JSON_OPTION
@pass_ctx
def set_(ctx: Context, name: str, selector: dict[str, str], max_live: int, as_json: bool) -> None:
    """Create or change the limit NAME.

    \b
    Example:
      unitvisor limits set batch --selector team=batch --max 20
    """
    with ctx.connect() as conn:
        try:
            created = store.set_limit(conn, name, selector, max_live)
        except store.DatabaseError as exc:
            raise Failure(str(exc)) from None
    if as_json:
        click.echo(json.dumps({"name": name, "selector": selector, "max_live": max_live, "created": created},
                              indent=2))
    else:
        click.echo(f"limit {name} {'set' if created else 'changed'}: at most {max_live} live runs with "
                   f"{_selector_text(selector)}")


@limits.command()
@click.argument("name")
@_JSON_OPTION
@pass_ctx
def drop(ctx: Context, name: str, as_json: bool) -> None:
    """Drop the limit NAME: its runs are held back by it no more. No such limit: exit 1.

    \b
    Example:
      unitvisor limits drop batch
    """
    with ctx.connect() as conn:
        dropped = store.drop_limit(conn, name)
    if not dropped:
        raise Failure(f"no limit named {name!r} (see `unitvisor limits`)")
    if as_json:
        click.echo(json.dumps({"name": name, "dropped": True}, indent=2))
    else:
        click.echo(f"limit {name} dropped")

"""The commands on hosts: hosts (the list), hosts add, hosts forget, hosts confirm-down, drain and undrain."""

from __future__ import annotations

import json
import secrets

import click

from supervisor import fleet, store
from supervisor.cli.app import Context, Failure, cli, invocation, pass_ctx
from supervisor.cli.output import iso, label_text, print_table, state_cell
from supervisor.quantities import format_duration, format_size


# The metavar spelled out: click 8.1 would print `COMMAND [ARGS]...` (as if a subcommand were required),
# 8.2 and newer `[COMMAND] [ARGS]...`; docs/cli.md must read the same under both.
@cli.group(invoke_without_command=True, subcommand_metavar="[COMMAND] [ARGS]...")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def hosts(click_ctx: click.Context, as_json: bool) -> None:
    """List hosts: state, heartbeat age, capacity, runs in flight and admission by pressure.

    STATE is active, draining, stopped or dead; `(drained)` for a stopped or dead host that comes
    back draining, `(stale)` once a host missed two heartbeats (before the fleet declares it dead),
    `(conflict)` while a second daemon with its id is being refused.
    ADMISSION is what the host claims by the pressure of its runs' slice ([host] pressure_slow_at,
    pressure_stop_at): open, slowed (fewer), stopped (none) or off (PSI not read), with the figure
    that decided; `-` for a daemon that does not report it. LABELS are its [host] labels, which a
    run's --host-label must all be among (`-`: none, or a daemon older than schema 033, which registers none).

    \b
    Example:
      unitvisor hosts
      unitvisor hosts forget web-7
    """
    if click_ctx.invoked_subcommand is not None:
        invocation["command"] = f"hosts {click_ctx.invoked_subcommand}"
        return
    ctx: Context = click_ctx.obj
    with ctx.connect() as conn:
        rows = store.list_hosts(conn)
    if as_json:
        click.echo(json.dumps([{
            "id": r["id"], "name": r["name"], "state": r["state"], "display_state": fleet.host_display_state(r),
            "max_runs": r["max_runs"], "memory_budget": r["memory_budget"], "version": r["version"],
            "started_at": iso(r["started_at"]), "heartbeat_at": iso(r["heartbeat_at"]),
            "heartbeat_age_seconds": round(r["heartbeat_age"], 3), "in_flight": r["in_flight"],
            "epoch": r["epoch"], "instance": r["instance"], "can_start": r["can_start"],
            "cannot_start_reason": r["cannot_start_reason"], "allowed_executables": r["allowed_executables"],
            "run_user": r["run_user"], "allowed_users": r["allowed_users"],
            "poll_interval_seconds": r["poll_interval_sec"], "host_dead_after_seconds": r["dead_after_sec"],
            "dead_at": iso(r["dead_at"]), "dead_reason": r["dead_reason"],
            "comes_back_draining": r["comes_back_draining"],
            "conflict": r["conflict_detail"] if "conflict" in fleet.host_display_state(r) else None,
            "down_confirmed_at": iso(r["down_confirmed_at"]), "down_confirmed_by": r["down_confirmed_by"],
            "returned_late_at": iso(r["returned_late_at"]),
            "pressure": _pressure_json(r),
            "labels": r["labels"],
        } for r in rows], indent=2))
        return
    table = [("HOST", "NAME", "STATE", "HEARTBEAT", "RUNS", "MAX", "MEMORY BUDGET", "ADMISSION", "VERSION", "LABELS")]
    notes = []
    for r in rows:
        shown = fleet.host_display_state(r)
        table.append((r["id"], r["name"], state_cell(r["state"], shown), format_duration(r["heartbeat_age"]) + " ago",
                      str(r["in_flight"]), str(r["max_runs"]), format_size(r["memory_budget"]), _admission(r),
                      r["version"] or "-", label_text(r["labels"])))
        if r["state"] == "dead" and r["dead_reason"]:
            notes.append(f"{r['id']}: dead: {r['dead_reason']}")
        if "conflict" in shown:
            notes.append(f"{r['id']}: conflict: {r['conflict_detail']}")
        if r["down_confirmed_at"] is not None:
            notes.append(f"{r['id']}: confirmed down by {r['down_confirmed_by']} at {iso(r['down_confirmed_at'])}: "
                         "declared dead once silent for its host_dead_after")
        if not r["can_start"]:
            notes.append(f"{r['id']}: claims nothing: {r['cannot_start_reason']}")
        pressure_said = _pressure_json(r)
        if pressure_said and pressure_said["state"] != "open" and pressure_said["detail"]:
            notes.append(f"{r['id']}: {pressure_said['detail']}")
    print_table(table)
    for note in notes:
        click.echo(note)


def _pressure_json(r: dict) -> dict | None:
    """A host's admission by pressure as its daemon last reported it; None where it reports none (a
    daemon before 0.7.0), or the report is its previous daemon's (sql/018_admission_pressure.sql)."""
    if r.get("pressure_state") is None or r.get("pressure_stale"):
        return None
    return {"state": r["pressure_state"], "resource": r["pressure_resource"],
            "figures": r["pressure_figures"] or {}, "detail": r["pressure_detail"],
            "age_seconds": round(r["pressure_age"], 3) if r["pressure_age"] is not None else None}


def _admission(r: dict) -> str:
    said = _pressure_json(r)
    if said is None:
        return "-"
    figure = (said["figures"] or {}).get(said["resource"]) if said["resource"] else None
    if figure is None or said["state"] == "off":
        return said["state"]
    return f"{said['state']} ({said['resource']} {figure:.0f}%)"


@hosts.command()
@click.argument("host")
@click.option("--keep-role", is_flag=True,
              help="Leave the host's login role as it is (it still logs in); a later forget without it drops it.")
@pass_ctx
def forget(ctx: Context, host: str, keep_role: bool) -> None:
    """Remove a dead (or stopped) host once none of its runs is open, and drop its login role.

    The role bound to HOST (by `hosts add`) is dropped, so that the retired host's DSN logs in no
    more; a role that still owns something in the cluster is made NOLOGIN and taken out of
    unitvisor_host instead. Dropping a role needs the right to create roles, as `hosts add` does (the
    postgres superuser): by any other role nothing changes, unless --keep-role. A role whose host
    was forgotten before (with --keep-role, or by unitvisor 0.7) is dropped by forgetting the host again.

    \b
    Example:
      runuser -u postgres -- unitvisor --dsn 'host=/var/run/postgresql dbname=unitvisor' \\
          hosts forget web-7
    """
    with ctx.connect() as conn:
        try:
            forgotten = store.retire_host(conn, host, keep_role)
        except store.RoleNotDropped as exc:
            raise Failure(f"host {host} is not forgotten: dropping its login role {exc.role} needs the right to "
                          "create roles, which this role lacks; run it as postgres on the database's machine "
                          f"(runuser -u postgres -- unitvisor --dsn 'host=/var/run/postgresql dbname=unitvisor' "
                          f"hosts forget {host}), or give --keep-role and drop the role later") from None
    if forgotten.state is None and forgotten.role is None:
        raise Failure(f"no host {host} (see `unitvisor hosts`)")
    if forgotten.open_count:
        raise Failure(f"host {host} still has {forgotten.open_count} open attempt(s); they are taken over once it "
                      "is declared dead")
    if forgotten.state not in ("dead", "stopped", None):
        raise Failure(f"host {host} is {forgotten.state}: only a dead or stopped host can be forgotten (drain it, "
                      "let its runs finish, and stop its daemon first)")
    click.echo(forget_text(host, forgotten))


@hosts.command("confirm-down")
@click.argument("host")
@pass_ctx
def confirm_down(ctx: Context, host: str) -> None:
    """Say that HOST is down, so that the fleet declares it dead once it is silent for its host_dead_after.

    While more than half of the fleet, and more than [fleet] max_dead_per_pass hosts, are silent at
    once, the fleet upkeep declares nobody dead (`host-dead-held why=fleet-silent`): that many hosts
    silent together is more likely the database or its network than that many machines down. When they
    are down (a power loss), confirm each: it is declared as soon as it is overdue, whatever the
    fleet-wide guards say, and its runs are settled `lost` and retried by their policy. Only confirm a
    host whose machine is off or cut off: a host declared dead while it runs stops its runs (if its
    stop_runs_when_cut_off is set) or they may run a second time. The confirmation ends when the host is
    heard from again. Needs the admin's DSN (the database owner's).

    \b
    Example:
      runuser -u postgres -- unitvisor --dsn 'host=/var/run/postgresql dbname=unitvisor' \\
          hosts confirm-down web-7
    """
    invocation["needs"] = "unitvisor_admin (the database owner)"
    with ctx.connect() as conn:
        state = store.confirm_host_down(conn, host)
    if state is None:
        raise Failure(f"no host {host} (see `unitvisor hosts`)")
    if state == "dead":
        click.echo(f"host {host} is dead already: nothing to confirm")
    else:
        click.echo(f"host {host} ({state}) confirmed down: declared dead once silent for its host_dead_after, "
                   "unless it is heard from first")


def forget_text(host: str, forgotten: store.Forgotten) -> str:
    """What `hosts forget` did, in one line: the host, and what became of its login role."""
    said = f"host {host} forgotten" if forgotten.state else f"host {host} was forgotten before"
    role = forgotten.role
    if role is None:
        return f"{said}; no login role was bound to it"
    if forgotten.role_fate == "dropped":
        return f"{said}; its login role {role} dropped: its DSN logs in no more"
    if forgotten.role_fate == "disabled":
        return (f"{said}; its login role {role} disabled (NOLOGIN, no longer a member of unitvisor_host), not "
                f"dropped: {forgotten.kept_because}")
    return (f"{said}; its login role {role} kept (--keep-role): it still logs in; drop it with "
            f"`unitvisor hosts forget {host}` as postgres")


@hosts.command("add")
@click.argument("name")
@click.option("--role", "role_name", metavar="ROLE",
              help="The login role to create [default: unitvisor_host_NAME, lowercase, other characters as _].")
@click.option("--new-password", is_flag=True,
              help="Give the role already bound to NAME a new password (the old one stops working).")
@click.option("--connection-limit", type=click.IntRange(1, 10000), metavar="N",
              help=f"How many sessions the role may hold at once [default: {store.DEFAULT_HOST_CONNECTION_LIMIT} for "
                   "a new role; with --new-password, unchanged unless given].")
@click.option("--river", is_flag=True,
              help="Make the new role a member of unitvisor_river too, for a host whose daemon serves a River "
                   "source ([river]): that creates runs, which a plain host role may not (docs/river.md, "
                   "Privileges).")
@click.option("--force", is_flag=True,
              help="With --new-password: rotate even while NAME's daemon is live (it is locked out at its next "
                   "reconnect until its /etc/unitvisor/dsn has the new password).")
@click.option("--db-host", metavar="HOST",
              help="The database server the printed DSN names [default: the one this command connects to], "
                   "e.g. when this command comes in over the local socket.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def add(ctx: Context, name: str, role_name: str | None, new_password: bool, connection_limit: int | None,
        river: bool, force: bool, db_host: str | None, as_json: bool) -> None:
    """Give host NAME its own database role, bound to the host id NAME.

    Creates a login role with a random password, a member of unitvisor_host, bound to NAME, in one
    transaction, and prints what goes in that host's /etc/unitvisor/dsn (this command's DSN with that
    role and password, which are shown only now) and the [host] id for its config. The host's daemon may
    then act only as NAME (with --river, also serve a River source). Needs unitvisor_admin and the right
    to create roles (a superuser, or CREATEROLE). A NAME that has a role already is an error (exit 1);
    --new-password rotates its password. The role may hold --connection-limit sessions at once: the
    daemon needs one, and a moment after a lost network up to two more, plus one per command run with
    its DSN. A live daemon keeps its session, but is locked out at its next reconnect until its DSN file
    has the new password (it reads the file again before each attempt, no restart needed); so
    --new-password refuses while NAME is live (heartbeat within its host_dead_after) unless --force.

    \b
    Example:
      runuser -u postgres -- unitvisor --dsn 'host=/var/run/postgresql dbname=unitvisor' \\
          hosts add web-7 --db-host db.example.com
    """
    if not name.strip() or "\n" in name:
        raise click.BadParameter("a host id is a non-empty line", param_hint="NAME")
    if role_name is not None and (not role_name or len(role_name.encode()) > 63):
        raise click.BadParameter("a role name is 1 to 63 bytes", param_hint="--role")
    if new_password and role_name is not None:
        raise click.UsageError("--new-password keeps the role bound to NAME; leave out --role")
    if force and not new_password:
        raise click.UsageError("--force goes with --new-password")
    if river and new_password:
        raise click.UsageError(f"--river goes with a new role; to an existing one: GRANT {store.RIVER_ROLE} TO "
                               "its role, as postgres (docs/river.md, Privileges)")
    password = secrets.token_urlsafe(24)
    dsn = ctx.dsn()
    with ctx.connect() as conn:
        if new_password:
            _refuse_rotation_of_a_live_host(conn, name, force)
            role = store.set_host_role_password(conn, name, password, connection_limit)
            if role is None:
                raise Failure(f"host id {name} has no role yet: run `unitvisor hosts add {name}` "
                              "without --new-password")
        else:
            role = role_name or store.default_host_role_name(name)
            store.add_host_role(conn, name, role, password,
                                connection_limit or store.DEFAULT_HOST_CONNECTION_LIMIT, river)
    host_dsn = store.dsn_for_role(dsn, role, password, db_host)
    config_lines = f'[host]\nid = "{_toml_string(name)}"'
    if as_json:
        click.echo(json.dumps({"host_id": name, "role": role, "dsn": host_dsn, "config": config_lines,
                               "new_password": new_password, "river": river}, indent=2))
        return
    click.echo(f"# host {name}: role {role}" + (" has a new password" if new_password else " created and bound")
               + (f", a member of {store.RIVER_ROLE}" if river else ""))
    click.echo(f"# /etc/unitvisor/dsn on {name} (mode 0600; the password is shown only now):")
    click.echo(host_dsn)
    click.echo(f"# /etc/unitvisor/unitvisor.toml on {name}:")
    click.echo(config_lines)


def _refuse_rotation_of_a_live_host(conn: store.Connection, name: str, force: bool) -> None:
    """A live host's daemon is locked out at its next reconnect (a failover, a network blip) until its
    DSN file has the new password: its runs go unrecorded and, after host_dead_after, run again
    elsewhere (or are stopped by its fence). Refused unless forced, and warned about when forced."""
    row = next((r for r in store.list_hosts(conn) if r["id"] == name), None)
    if row is None or row["state"] not in ("active", "draining"):
        return
    dead_after = row["dead_after_sec"] or 60.0
    if row["heartbeat_age"] >= dead_after:
        return
    what = (f"host {name} is live (heartbeat {format_duration(row['heartbeat_age'])} ago): its daemon keeps its "
            "session but is locked out at its next reconnect until /etc/unitvisor/dsn on it has the new password, "
            f"and after {dead_after:g}s (host_dead_after) its runs may run again elsewhere")
    if not force:
        raise Failure(f"{what}; drain and stop it first, or give --force and write the new DSN on it at once")
    click.echo(f"unitvisor: warning: {what}: write the new DSN on it now", err=True)


def _toml_string(value: str) -> str:
    """The inside of a TOML basic string."""
    return value.replace("\\", "\\\\").replace('"', '\\"')


def _set_host_state(ctx: Context, host: str | None, state: str) -> None:
    host = host or ctx.settings.host_id
    # The admin may drain any host, a host's own role only its own id (sql/021_operator.sql).
    invocation["needs"] = f"unitvisor_admin, or the role of host {host}"
    with ctx.connect() as conn:
        before = store.set_host_state(conn, host, state)
    if before is None:
        raise Failure(f"no host {host} (see `unitvisor hosts`)")
    if before == "dead":  # set_host_state changes nothing: a dead host is made live only by registering
        raise Failure(f"host {host} is dead: nothing changed; it becomes live again when its daemon registers "
                      "(a drain set before it died is kept)")
    if before.startswith("stopped"):  # stays stopped; the drain is kept for its next start (schema 24)
        after = "stopped (drained)" if state == "draining" else "stopped"
        comes_back = f"its daemon comes back {state} when it starts"
        if before == after:
            click.echo(f"host {host} is already {after}: {comes_back}")
        else:
            click.echo(f"host {host}: {before} -> {after}: {comes_back}")
    elif before == state:
        click.echo(f"host {host} is already {state}")
    else:
        click.echo(f"host {host}: {before} -> {state}")


@cli.command()
@click.argument("host", required=False)
@pass_ctx
def drain(ctx: Context, host: str | None) -> None:
    """Stop a host from claiming new runs; its runs finish. [default HOST: this one]

    The daemon sees it at its next heartbeat, and says so in its journal (host-state). Needs the
    admin's DSN, or on the host itself its own (/etc/unitvisor/dsn): a host may drain only itself.

    \b
    Example:
      unitvisor drain web-7
    """
    _set_host_state(ctx, host, "draining")


@cli.command()
@click.argument("host", required=False)
@pass_ctx
def undrain(ctx: Context, host: str | None) -> None:
    """Let a drained host claim runs again. [default HOST: this one]

    As drain: the admin's DSN, or the host's own for itself.

    \b
    Example:
      unitvisor undrain web-7
    """
    _set_host_state(ctx, host, "active")

"""The commands that keep a host and its database working: reconcile, doctor, prune, migrate, and
the two services' own entry points (daemon, fence), with version."""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta

import click

from supervisor import __version__, config, store
from supervisor.cli.app import Context, Failure, cli, pass_ctx
from supervisor.cli.output import print_table, state_cell
from supervisor.cli.params import IntRange, quantity
from supervisor.quantities import format_duration, parse_duration


@cli.command()
@click.option("--dry-run", is_flag=True, help="Print what a pass would do, and do nothing.")
@pass_ctx
def reconcile(ctx: Context, dry_run: bool) -> None:
    """Compare this host's runs with systemd's units now, and repair what differs.

    Safe while the daemon runs: every action is idempotent. Needs root (it talks to systemd).

    \b
    Example:
      unitvisor reconcile --dry-run
    """
    from supervisor import log
    from supervisor.reconciler import Reconciler
    from supervisor.systemd import Systemd, SystemdError

    log.setup(ctx.debug)
    settings = ctx.settings
    with ctx.connect() as conn:
        found = store.host_fence(conn, settings.host_id)
        if found is None:
            raise Failure(f"host {settings.host_id} is not registered: start the daemon (systemctl start unitvisor)")
        state, fence = found
        if state == "dead" and not dry_run:
            raise Failure(f"host {settings.host_id} was declared dead and its runs taken over: start or restart the "
                          "daemon, which registers again and stops what was taken over")
        systemd = Systemd(max_held=0)  # this command's connection ends with it (Systemd's docstring)
        try:
            reconciler = Reconciler(settings, fence, conn, systemd)
            done = reconciler.plan() if dry_run else reconciler.reconcile_pass()
        except SystemdError as exc:
            raise Failure(str(exc)) from None
        finally:
            systemd.close()
    rows = [("UNIT", "RUN", "ACTION", "REASON")]
    for item in done:
        rows.append((item.decision.unit_name, str(item.run.id)[:8] if item.run else "-",
                     item.decision.action.value, item.decision.reason))
    if len(rows) == 1:
        click.echo("nothing to reconcile: no open attempts and no units of ours on this host")
        return
    print_table(rows)



@cli.command()
@click.pass_context
def doctor(click_ctx: click.Context) -> None:
    """Check that this host can run runs; exit 1 if anything fails.

    \b
    Example:
      unitvisor doctor
    """
    from supervisor.doctor import run_checks

    ctx: Context = click_ctx.obj
    checks = run_checks(ctx.config_path, ctx.dsn_override, ctx.dsn_file_override)
    width = max(len(c.name) for c in checks)
    for check in checks:
        click.echo(f"{state_cell(check.status, check.status.ljust(4))}  {check.name.ljust(width)}  {check.message}")
    if any(c.status == "fail" for c in checks):
        sys.exit(1)


# How long `prune` waits for a daemon's batch (or another prune) to let go of the lock before it says so.
PRUNE_BUSY_WAIT = 60.0


@cli.command()
@click.option("--older-than", metavar="DURATION",
              callback=quantity(parse_duration, 1, 10**10, "1s to 115740d", "seconds"),
              help="Delete runs finished longer ago than this, like 30d [default: [retention] keep_finished of "
                   "the config, as the daemons prune].")
@click.option("--dry-run", is_flag=True, help="Count what would be deleted, and delete nothing.")
@click.option("--batch-size", type=IntRange(1, 100000), default=1000, show_default=True,
              help="Runs deleted per transaction.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def prune(ctx: Context, older_than: float | None, dry_run: bool, batch_size: int, as_json: bool) -> None:
    """Delete finished runs older than --older-than, with their attempts, events and spawn jobs.

    Also claimed and discarded spawn jobs of that age of runs that are kept. A run that is queued,
    starting or running, or has an attempt without an outcome, is never deleted. Each batch commits
    on its own; an interrupted prune keeps what it deleted. The daemons do the same by themselves
    ([retention] in the config). Needs unitvisor_admin.

    \b
    Example:
      unitvisor prune --older-than 30d --dry-run
    """
    if older_than is None:
        older_than = ctx.settings.retention.keep_finished
        if older_than is None:
            raise click.UsageError('give --older-than: [retention] keep_finished is "off" in the config')
    age = timedelta(seconds=older_than)
    with ctx.connect() as conn:
        if dry_run:
            total = store.prune_count(conn, age)
        else:
            total = store.Pruned(0, 0, 0, 0)
            busy_since: float | None = None
            while True:
                batch = store.prune_batch(conn, age, batch_size)
                if batch.busy:
                    # A daemon's batch (or another prune) holds the lock; it lets go within a second.
                    if busy_since is None:
                        busy_since = time.monotonic()
                    if time.monotonic() - busy_since > PRUNE_BUSY_WAIT:
                        raise Failure(f"another session has been pruning for {PRUNE_BUSY_WAIT:.0f}s; "
                                      f"{total.runs} runs deleted so far; try again later")
                    time.sleep(0.2)
                    continue
                busy_since = None
                total += batch
                if not batch.full(batch_size):
                    break
    if as_json:
        click.echo(json.dumps({"dry_run": dry_run, "older_than_seconds": older_than, "runs": total.runs,
                               "attempts": total.attempts, "events": total.events, "jobs": total.jobs}, indent=2))
        return
    click.echo(f"{'would delete' if dry_run else 'deleted'} {total.runs} run(s) finished more than "
               f"{format_duration(older_than)} ago, with {total.attempts} attempt(s) and {total.events} event(s); "
               f"{total.jobs} spawn job(s) in all")


@cli.command()
@pass_ctx
def migrate(ctx: Context) -> None:
    """Apply missing database migrations (safe to run from several hosts at once)."""
    with ctx.connect(schema=False) as conn:
        try:
            # Said on stderr, so that a second migrate that waits minutes for the first does not look hung.
            applied = store.migrate(conn, on_wait=lambda why: click.echo(why, err=True))
        except store.DatabaseError as exc:
            raise Failure(str(exc)) from None
    if applied:
        click.echo(f"applied: {', '.join(applied)}")
    else:
        click.echo("schema is current; nothing to apply")


@cli.command()
@pass_ctx
def daemon(ctx: Context) -> None:
    """Run the host daemon (as systemd's unitvisor.service does)."""
    from supervisor import log
    from supervisor.daemon import Daemon

    log.setup(ctx.debug)
    settings = ctx.settings
    sys.exit(Daemon(settings, lambda: config.resolve_dsn(settings, ctx.dsn_override, ctx.dsn_file_override)).run())


@cli.command("fence")
@pass_ctx
def fence_command(ctx: Context) -> None:
    """Stop this host's runs once its daemon's heartbeat lease expires (as unitvisor-fence.service does).

    With [fleet] stop_runs_when_cut_off, the daemon writes /run/unitvisor/lease at each heartbeat; when
    it expires (the daemon stopped, crash-looping or cut off from the database) this stops every
    unitvisor-run-* unit before another host may declare this one dead. Needs no database.
    """
    from supervisor import fence, log

    log.setup(ctx.debug)
    # The configuration is read only when runs exist without a lease, and again each time: a fence
    # must not fail to start, or stop fencing, because of a configuration the daemon rejects too.
    sys.exit(fence.Fence(lambda: config.load(ctx.config_path)).run())


@cli.command()
def version() -> None:
    """Print the version."""
    click.echo(f"unitvisor {__version__}")

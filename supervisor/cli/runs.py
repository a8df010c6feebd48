"""The commands on runs: submit, show, runs, cancel, resume, logs and wait."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from datetime import datetime, timedelta
from typing import Any

import click

from supervisor import fleet, stopsignals, store
from supervisor.cli.app import Context, CouldNotTell, Failure, Unreachable, cli, pass_ctx
from supervisor.cli.failure import (
    attempt_label,
    attempts_line,
    failure_fields,
    failure_json,
    failure_options,
    rules_line,
)
from supervisor.cli.lookup import load_run, no_run, partial_list_note, resolve_run_id
from supervisor.cli.output import (
    AVOID_FAILED_HOST,
    accounting_text,
    attempts_text,
    command_text,
    iso,
    label_text,
    not_measured_text,
    placement_text,
    print_table,
    run_json,
    state_cell,
    state_phrase,
    wait_text,
)
from supervisor.cli.params import (
    MIN_MEMORY,
    IntRange,
    at_time,
    concurrency_key,
    env_pairs,
    label_pairs,
    quantity,
    signal_name,
    time_or_duration,
    whole_seconds,
)
from supervisor.journal import Journal, log_command
from supervisor.model import RUN_STATES, TERMINAL_STATES, Accounting, Attempt, OutcomeRecord, Run
from supervisor.quantities import format_duration, format_size, parse_duration, parse_percent, parse_size


@cli.command()
@click.option("--memory", callback=quantity(parse_size, MIN_MEMORY, 1 << 62, "1M to 4E", "bytes"),
              help="Memory limit (MemoryMax), like 512M or 2G; 1M to 4E. A bare number is bytes.")
@click.option("--memory-high", callback=quantity(parse_size, MIN_MEMORY, 1 << 62, "1M to 4E", "bytes"),
              help="Memory throttle (MemoryHigh): over it the run is slowed and its memory reclaimed, not "
                   "killed; like 384M; at most --memory. A bare number is bytes.")
@click.option("--cpu", callback=quantity(parse_percent, 1, 100000, "1% to 100000%", "%"),
              help="CPU quota, like 50% or 200% (two CPUs); 1% to 100000%.")
@click.option("--tasks", type=IntRange(1, 4194304), help="Maximum number of tasks (TasksMax).")
@click.option("--io-weight", type=IntRange(1, 10000), help="IO weight, 1 to 10000 (IOWeight).")
@click.option("--runtime", callback=quantity(whole_seconds, 1, 315360000, "1s to 3650d", "seconds"),
              help="Runtime limit in whole seconds, like 90s, 10m or 2h (1s to 3650d); the run is stopped after it.")
@click.option("--max-attempts", type=IntRange(1, 1000), default=1, show_default=True,
              help="Attempts in all, the first included.")
@click.option("--env", "environment", multiple=True, callback=env_pairs, metavar="NAME=VALUE",
              help="Environment variable (repeatable). Its value is on this command line, which other users of "
                   "this machine can see while it runs: submit secrets with unitvisor.submit_run instead.")
@click.option("--workdir", help="Working directory (absolute).")
@click.option("--user", "run_user", help="Run as this user (the host must allow it).")
@click.option("--host", "host_pin", help="Only this host id may run it.")
@click.option("--priority", type=IntRange(-(2**31), 2**31 - 1), default=0, show_default=True,
              help="Higher runs first.")
@click.option("--private-network", is_flag=True,
              help="No network but the run's own loopback (PrivateNetwork=yes).")
@click.option("--label", "labels", multiple=True, callback=label_pairs, metavar="KEY=VALUE",
              help="Tag the run (repeatable); find it again with `runs --label`.")
# Placement (schema 033; docs/sql-api.md, "Placement").
@click.option("--host-label", "host_labels", multiple=True, callback=label_pairs, metavar="KEY=VALUE",
              help="Run only on a host with this label in its [host] labels (repeatable: all of them).")
@click.option("--avoid-failed-host", type=click.Choice(sorted(AVOID_FAILED_HOST)), metavar="WHEN",
              help="When a retry prefers another host than the one its last attempt failed on: lost (after a lost "
                   "attempt: the default), any (after any failed attempt) or never.")
@click.option("--idempotency-key", metavar="KEY",
              help="Submit at most once per KEY: a repeated submit prints the first run's id and queues nothing.")
@click.option("--concurrency-key", metavar="KEY", callback=concurrency_key,
              help="Never run beside another run with this KEY, on any host: runs with one KEY start one at a "
                   "time, in the order they were submitted.")
@click.option("--concurrency-limit", type=click.IntRange(1, 10000), metavar="N",
              help="Let N runs of its --concurrency-key run at once (still started in submission order) "
                   "[default: 1]. Runs of one key that ask for different limits: the smallest among the "
                   "starting run's and the live runs' applies.")
@click.option("--not-before", metavar="TIME", callback=time_or_duration,
              help="Start no earlier than TIME: ISO 8601 (2026-12-01T03:00Z; without an offset, local time) or "
                   "+DURATION from now by the database's clock (+10m).")
@click.option("--start-deadline", metavar="TIME", callback=time_or_duration,
              help="A run that has not started by TIME (as --not-before) ends as expired.")
# Graceful stop (schema 026; docs/sql-api.md, "Graceful stop").
@click.option("--stop-signal", metavar="SIGNAL", callback=signal_name,
              help="Signal that stops the run, on cancel and at --runtime (KillSignal); default TERM. One of "
                   + ", ".join(stopsignals.SIGNALS) + ", with or without SIG.")
@click.option("--stop-timeout", callback=quantity(whole_seconds, 1, 3600, "1s to 1h", "seconds"),
              help="How long the run may take to end after its stop signal before SIGKILL (TimeoutStopSec), "
                   "like 30s; default the host's [systemd] stop_grace.")
@click.option("--warn-before", callback=quantity(whole_seconds, 1, 315360000, "1s to 3650d", "seconds"),
              help="Send --warn-signal this long before --runtime ends the run, like 5m, so that it can "
                   "checkpoint; needs --runtime.")
@click.option("--warn-signal", metavar="SIGNAL", callback=signal_name,
              help="The signal --warn-before sends to the run's main process; default USR1.")
@failure_options
@click.option("--hold", is_flag=True,
              help="Submit it held: queued, but no host claims it until `unitvisor release RUN`.")
@click.option("--after", "after", multiple=True, metavar="RUN",
              help="Run only after RUN has ended (repeatable: after all of them); by default RUN must succeed, "
                   "or this run ends skipped. A run id or a unique prefix of one.")
@click.option("--after-policy", type=click.Choice(("succeeded", "finished")),
              help="What --after needs of each RUN: succeeded (the default), or finished (ended in any way).")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED, metavar="-- COMMAND [ARG]...")
@pass_ctx
def submit(ctx: Context, command: tuple[str, ...], **options: Any) -> None:
    """Queue a run; print its id.

    \b
    Example:
      unitvisor submit --memory 256M --cpu 50% --tasks 32 -- /usr/bin/python3 -c 'print("hi"); exit(3)'
    """
    if not command[0].startswith("/"):
        raise click.UsageError(f"the command must be an absolute path, not {command[0]!r}")
    if options["workdir"] is not None and (not options["workdir"].startswith("/") or "\n" in options["workdir"]):
        raise click.UsageError(f"--workdir must be an absolute path, not {options['workdir']!r}")
    high, limit = options["memory_high"], options["memory"]
    if high is not None and limit is not None and high > limit:
        # As unitvisor.submit_run refuses it (runs_memory_high_valid): throttled above the kill is never.
        raise click.UsageError(f"--memory-high: {format_size(high)} is above --memory {format_size(limit)}: "
                               "a run is throttled before it is killed")
    fields = {
        "argv": list(command), "environment": options["environment"] or None,
        "working_directory": options["workdir"], "run_user": options["run_user"],
        "memory_max": options["memory"], "cpu_quota_percent": options["cpu"], "tasks_max": options["tasks"],
        "io_weight": options["io_weight"], "runtime_max_sec": options["runtime"],
        "max_attempts": options["max_attempts"], "host_pin": options["host_pin"], "priority": options["priority"],
        # Only when asked, as below: a database before schema 017 then still takes the run.
        "memory_high": options["memory_high"],
        # Only when asked: a database from before schema 003 then still takes the run.
        "private_network": options["private_network"] or None,
        "labels": options["labels"] or None, "idempotency_key": options["idempotency_key"],
        "concurrency_key": options["concurrency_key"],
        # Only when asked: a database before schema 032 then still takes the run.
        "concurrency_limit": options["concurrency_limit"],
        **failure_fields(options),  # issue 25: only those asked for
        # Only when asked: a database before schema 030 then still takes the run.
        "hold": options["hold"] or None,
        # Only when asked, as hold: a database before schema 033 then still takes the run.
        "host_labels": options["host_labels"] or None,
        "avoid_failed_host": AVOID_FAILED_HOST.get(options["avoid_failed_host"]),
    }
    # Graceful stop (schema 026): only when asked, so that a database before it still takes the run.
    stop = {"stop_signal": options["stop_signal"], "stop_timeout": options["stop_timeout"],
            "warn_before": options["warn_before"], "warn_signal": options["warn_signal"]}
    if stop["warn_before"] is not None and options["runtime"] is None:
        raise click.UsageError("--warn-before: needs --runtime (the warning is sent that long before it ends the run)")
    if stop["warn_before"] is not None and stop["warn_before"] >= options["runtime"]:
        raise click.UsageError("--warn-before: must be less than --runtime")
    if stop["warn_signal"] is not None and stop["warn_before"] is None:
        raise click.UsageError("--warn-signal: needs --warn-before")
    if stop["warn_signal"] == "KILL":
        raise click.UsageError("--warn-signal: KILL is no warning (it would end the run)")
    fields.update({key: value for key, value in stop.items() if value is not None})
    with ctx.connect() as conn:
        # Only when a time is relative: then the database's clock, which decides when it is due, says
        # what "now" is.
        now = store.now(conn) if any(isinstance(options[k], timedelta) for k in ("not_before", "start_deadline")) \
            else None
        fields["not_before"] = at_time(options["not_before"], now)
        fields["start_deadline"] = at_time(options["start_deadline"], now)
        # Dependencies (schema 035): only when asked, so that a database before it still takes the run.
        if options["after_policy"] and not options["after"]:
            raise click.UsageError("--after-policy: needs --after (the runs it runs after)")
        if options["after"]:
            fields["after"] = [resolve_run_id(conn, text) for text in options["after"]]
            fields["after_policy"] = options["after_policy"]
        if fields["not_before"] and fields["start_deadline"] and fields["start_deadline"] <= fields["not_before"]:
            raise click.UsageError("--start-deadline: must be later than --not-before")
        try:
            run_id = store.submit_run(conn, **fields)
        except store.DatabaseError as exc:
            raise Failure(str(exc)) from None
        refused = store.fleet_refusals(conn, [run_id]).get(run_id)
    click.echo(str(run_id))
    if refused:
        # Queued all the same (a host may come, or be allowed it, later), but said now rather than by
        # `show` after two poll intervals: a typo in --host or --user, or an executable no host allows.
        click.echo(f"unitvisor: warning: run {run_id} waits: {refused}", err=True)


def _add_dependencies(conn: store.Connection, run: Run, data: dict) -> None:
    """show's facts of schema 035: what the run needs of the runs it runs after, each of them with its
    state and whether that is what it needs (met: true, false when it can no longer be, null while it
    has not ended), and the runs that run after it."""
    policy, after = store.dependencies_of(conn, run.id)
    data["after_policy"] = policy
    data["after"] = [{"id": str(a["id"]), "state": a["state"], "met": a["met"]} for a in after]
    data["dependants"] = [str(d) for d in store.dependants_of(conn, run.id)]


def _dependency_lines(data: dict) -> list[str]:
    """show's lines for _add_dependencies' facts: none for a run that names no run and that none names."""
    lines = []
    if data["after"]:
        words = {True: "met", False: "can no longer be met", None: "waiting"}
        lines.append(f"  after:     {data['after_policy']} of each:")
        lines += [f"    {a['id']} {a['state']} ({words[a['met']]})" for a in data["after"]]
    if data["dependants"]:
        lines.append(f"  run after it: {len(data['dependants'])} (unitvisor runs --after {data['id'][:8]})")
    return lines


def _add_hold_and_freeze(conn: store.Connection, run: Run, data: dict) -> None:
    """show's facts of schema 030: when and by whom a queued run is held, and each attempt's freeze
    (what was asked, what its host did, in words)."""
    held_at, held_by = store.hold_of(conn, run.id)
    data["held"] = {"at": iso(held_at), "by": held_by} if run.state == "queued" and held_at else None
    freezes = store.freezes_of(conn, run.id)
    for a in data["attempts"]:
        f = freezes.get(a["attempt"])
        a["freeze"] = None if f is None else {
            "wanted": f["wanted"], "requested_at": iso(f["requested_at"]), "requested_by": f["requested_by"],
            "state": f["state"], "refused": f["refused"], "acted_at": iso(f["acted_at"]), "pending": f["pending"],
            "text": f["text"]}


# The COMMAND column's width without --wide.
COMMAND_WIDTH = 60
# `runs` asks the fleet why a queued run waits (a query over every host per run) for this many of the
# queued runs it lists at most; any further ones show what explain_waiting recorded.
MAX_REFUSALS_ASKED = 100

NETWORK_TEXT = {True: "none but loopback (--private-network)",
                False: "the host's, unless the host's [runs] private_network is true"}


def _waiting(conn: store.Connection, run: Run, data: dict) -> tuple[str | None, datetime | None, datetime | None]:
    """Why a queued run waits, with the hosts named where the database names none (a run held by a
    drain: "host web-1 is draining", fleet.name_the_hosts), and when its next attempt is due while it
    waits out a retry's backoff (with the database's now, to say how far off). Issue 24."""
    reason, due, now = data["wait_reason"], None, None
    if reason and fleet.NO_LIVE_HOST in reason:  # alone, or beside what explain_waiting recorded
        reason = reason.replace(fleet.NO_LIVE_HOST, fleet.name_the_hosts(fleet.NO_LIVE_HOST, store.list_hosts(conn)))
    if run.state == "queued" and data["attempts"]:
        due = store.next_attempt_at(conn, run.id)
        now = store.now(conn) if due is not None else None
    return reason, due, now


@cli.command()
@click.argument("run_id", metavar="RUN")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def show(ctx: Context, run_id: str, as_json: bool) -> None:
    """Show a run, its limits, attempts and recent events.

    A queued run says why it waits (naming the hosts that claim nothing when no host is live), and,
    while it waits out a retry's backoff, when its next attempt is due (next_attempt_at in --json).

    \b
    Example:
      unitvisor show 3f2a9c --json
    """
    with ctx.connect() as conn:
        run = load_run(conn, run_id)
        refused = store.fleet_refusals(conn, [run.id]).get(run.id)
        attempts = store.get_attempts(conn, run.id)
        data = run_json(run, attempts, store.get_events(conn, run.id), store.get_outcome_records(conn, run.id),
                        refused)
        data["failure_rules"] = failure_json(run, attempts)
        data["wait_reason"], due, now = _waiting(conn, run, data)
        data["next_attempt_at"] = iso(due)
        _add_hold_and_freeze(conn, run, data)
        _add_dependencies(conn, run, data)
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    limits = data["limits"]
    lines = [
        f"run {data['id']}",
        f"  state:     {run.state}",
    ]
    if data["wait_reason"]:
        lines.append(f"  waiting:   {data['wait_reason']}")
    if due is not None:
        lines.append(f"  waiting:   its retry: next attempt at {data['next_attempt_at']} "
                     f"(in {format_duration((due - now).total_seconds())})")
    lines += [
        f"  command:   {command_text(run.argv)}",
        f"  limits:    memory={format_size(limits['memory_max'])} memory-high={format_size(limits['memory_high'])} cpu="
        f"{str(limits['cpu_quota_percent']) + '%' if limits['cpu_quota_percent'] else '-'} "
        f"tasks={limits['tasks_max'] or '-'} io-weight={limits['io_weight'] or '-'} "
        f"runtime={format_duration(limits['runtime_max_sec'])}",
        f"  network:   {NETWORK_TEXT[run.private_network]}",
        f"  labels:    {label_text(run.labels)}",
    ]
    if run.host_labels or run.avoid_failed_host is not None:
        lines.append(f"  placement: {placement_text(run)}")
    stop = data["stop"]
    if any(stop[key] is not None for key in ("stop_timeout", "warn_before")) or stop["stop_signal"] != "TERM":
        warn = f" warn=SIG{stop['warn_signal']} {format_duration(stop['warn_before'])} before runtime" \
            if stop["warn_before"] else ""
        lines.append(f"  stop:      signal=SIG{stop['stop_signal']} timeout="
                     f"{format_duration(stop['stop_timeout']) if stop['stop_timeout'] else 'default'}{warn}")
    start = [f"{name} {data[key]}" for name, key in (("concurrency key", "concurrency_key"),
                                                     ("not before", "not_before"),
                                                     ("start deadline", "start_deadline")) if data[key]]
    if start and run.concurrency_limit > 1:  # schema 032: more than one at a time
        start[0] += f" (at most {run.concurrency_limit} live)"
    if start:
        lines.append(f"  start:     {'; '.join(start)}")
    rules = rules_line(run)
    if rules:
        lines.append(f"  failure:   {rules}")
    lines += _dependency_lines(data)
    lines.append(f"  attempts:  {attempts_line(run, attempts, attempts_text(len(attempts), run.max_attempts))}")
    for attempt, a in zip(attempts, data["attempts"], strict=True):
        lines.append(f"  {attempt_label(run, attempt)}: host={a['host']} unit={a['unit']} "
                     f"outcome={a['outcome'] or '-'} exit={a['exit_status'] or '-'} "
                     f"started={a['started_at'] or '-'} ended={a['ended_at'] or '-'}")
        if a["freeze"]:
            lines.append(f"    freeze: {a['freeze']['text']}")
        if a["reason"]:
            lines.append(f"    reason: {a['reason']}")
        if a["outcome"]:
            lines.append(f"    measured: {accounting_text(Accounting(**a['accounting']))}")
            if a["not_measured"]:
                lines.append(f"    not measured on its host: {not_measured_text(a['not_measured'])}")
            tail = a["output_tail"]
            kept = "-" if tail is None else f"the last {len(tail.splitlines())} lines kept with the outcome"
            lines.append(f"    output:   {kept}")
    lines.append("  events:")
    lines += [f"    {e['at']} {e['state']}: {e['reason']}" for e in data["events"]]
    lines.append(f"  logs:      {data['logs_command']}")
    click.echo("\n".join(lines))


@cli.command()
# A metavar, not the list of choices: with skipped (schema 035) the list no longer fits a man page's line.
@click.option("--state", "states", multiple=True, type=click.Choice(RUN_STATES), metavar="STATE",
              help="Only runs in this state (repeatable): " + ", ".join(RUN_STATES) + ".")
@click.option("--host", help="Only runs whose latest attempt is on this host.")
@click.option("--since", callback=quantity(parse_duration, 1, 10**10, "1s to 115740d", "seconds"),
              help="Only runs created this recently, like 1h.")
@click.option("--label", "labels", multiple=True, callback=label_pairs, metavar="KEY=VALUE",
              help="Only runs with this label (repeatable: all of them).")
@click.option("--held", is_flag=True, help="Only held runs (`unitvisor hold`, `submit --hold`).")
@click.option("--after", "after", metavar="RUN", help="Only the runs that run after RUN (`submit --after`).")
@click.option("--limit", type=IntRange(1, 100000), default=50, show_default=True)
@click.option("--wide", is_flag=True, help="Show the whole command, not its first 60 characters.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def runs(ctx: Context, states: tuple[str, ...], host: str | None, since: float | None, labels: dict[str, str],
         held: bool, after: str | None, limit: int, wide: bool, as_json: bool) -> None:
    """List runs, newest first.

    Below the table, why each queued run waits, as `show` says it. On a host's own DSN (the default
    on a host) runs pinned to other hosts are not listed, and a note on stderr says so.

    \b
    Example:
      unitvisor runs --state running --since 1h
    """
    with ctx.connect() as conn:
        rows = store.list_runs(conn, states, host, timedelta(seconds=since) if since else None, limit, labels,
                               held=held, after=resolve_run_id(conn, after) if after else None)
        now = store.now(conn)
        queued = [r["id"] for r in rows if r["state"] == "queued"][:MAX_REFUSALS_ASKED]
        refusals = store.fleet_refusals(conn, queued) if queued else {}
        partial = partial_list_note(conn)
    if partial:
        click.echo(f"note: {partial}", err=True)
    waits = {r["id"]: wait_text(r["wait_reason"], refusals.get(r["id"])) for r in rows if r["state"] == "queued"}
    if as_json:
        click.echo(json.dumps([{
            "id": str(r["id"]), "state": r["state"], "host": r["host_id"], "attempt": r["attempt"],
            "created_at": iso(r["created_at"]), "started_at": iso(r["started_at"]), "ended_at": iso(r["ended_at"]),
            "outcome": r["outcome"], "exit_status": r["exit_status"], "argv": r["argv"], "labels": r["labels"],
            "concurrency_key": r["concurrency_key"], "not_before": iso(r["not_before"]),
            "start_deadline": iso(r["start_deadline"]), "wait_reason": waits.get(r["id"]),
            "no_host_accepts": refusals.get(r["id"]), "held_at": iso(r["held_at"]),
        } for r in rows], indent=2))
        return
    table = [("ID", "STATE", "HOST", "ATTEMPT", "AGE", "DURATION", "OUTCOME", "COMMAND")]
    for r in rows:
        duration = None
        if r["started_at"]:
            duration = ((r["ended_at"] or now) - r["started_at"]).total_seconds()
        table.append((str(r["id"])[:8], state_cell(r["state"]), r["host_id"] or "-", str(r["attempt"] or "-"),
                      format_duration((now - r["created_at"]).total_seconds()), format_duration(duration),
                      r["outcome"] or "-", command_text(r["argv"], None if wide else COMMAND_WIDTH)))
    print_table(table)
    for r in rows:
        if waits.get(r["id"]):
            click.echo(f"{str(r['id'])[:8]}: waits: {waits[r['id']]}")


@cli.command()
@click.argument("run_id", metavar="RUN")
@pass_ctx
def cancel(ctx: Context, run_id: str) -> None:
    """Cancel a run: a queued one at once, a running one is stopped by its host (SIGTERM, then SIGKILL).

    \b
    Example:
      unitvisor cancel 3f2a9c
    """
    rid, result = _transition(ctx, run_id, store.cancel_run, "run {id} already {state}; nothing to cancel")
    click.echo(f"run {rid} cancelled" if result.state == "cancelled" else
               f"run {rid}: cancel requested; its host stops it")


def _transition(ctx: Context, run_id: str, request: Any, refused: str) -> tuple[uuid.UUID, store.Transition]:
    """An operator's request on one run; a refusal (formatted with the run's id and state) fails."""
    with ctx.connect() as conn:
        rid = resolve_run_id(conn, run_id)
        result = request(conn, rid)
        if result.state is None:
            raise no_run(conn, run_id)
    if not result.changed:
        raise Failure(refused.format(id=rid, state=result.state, is_state=state_phrase(result.state)))
    return rid, result


@cli.command()
@click.argument("run_id", metavar="RUN")
@click.option("--with-dependants", is_flag=True,
              help="Also reopen the runs skipped because of this one (and those below them): they wait for it "
                   "again.")
@pass_ctx
def resume(ctx: Context, run_id: str, with_dependants: bool) -> None:
    """Reopen a failed, cancelled, expired or skipped run: a new attempt with the command and limits its row has now.

    The run is queued again at once (an expired run's passed --start-deadline is dropped). Its
    attempts are numbered on from the last one, and a failed attempt is retried only while its
    number is below the run's --max-attempts. So a run that made N attempts of M gets max(1, M - N)
    more: one that used them all gets exactly one (if it fails, the run fails again at once: resume
    it again for another), one cancelled or failed earlier gets the attempts it had left. Earlier
    attempts and their outcomes are kept; a pending cancel is cleared.

    A run that runs after others (submit --after) waits for them again: it is skipped again at once
    if one of them still is not what it needs. The runs skipped because this one failed stay skipped
    unless --with-dependants reopens them too.

    \b
    Example:
      unitvisor resume 3f2a9c --with-dependants
    """
    reopened = 0

    def request(conn: store.Connection, rid: uuid.UUID) -> store.Transition:
        nonlocal reopened
        if not with_dependants:
            return store.resume_run(conn, rid)
        result, reopened = store.resume_with_dependants(conn, rid)
        return result

    rid, result = _transition(ctx, run_id, request,
                              "run {id} {is_state}; only a failed, cancelled, expired or skipped run can be resumed")
    if result.state == "skipped":
        raise Failure(f"run {rid} skipped again: a run it runs after still is not what it needs "
                      f"(unitvisor show {str(rid)[:8]})")
    below = f", and {reopened} run{'s' if reopened > 1 else ''} skipped below it queued again too" if reopened else ""
    click.echo(f"run {rid} queued again{below}")


@cli.command()
@click.argument("run_id", metavar="RUN")
@click.option("--attempt", type=IntRange(1), help="Only this attempt [default: all].")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new output.")
@click.option("--lines", "-n", type=IntRange(0), help="Only the last N lines.")
@pass_ctx
def logs(ctx: Context, run_id: str, attempt: int | None, follow: bool, lines: int | None) -> None:
    """Show a run's output from journald, also long after its unit is gone.

    The whole output lives in the journal of the host that ran the attempt, and is shown from there.
    Elsewhere (another host, or after that journal rotated or the host died) it shows the last lines
    kept with each ended attempt's outcome ([runs] output_tail_lines on the host that ran it),
    saying so on stderr. Several attempts are shown one after the other, each under a line
    `-- attempt N of run ... on host H: OUTCOME --` (--lines then counts per attempt).

    \b
    Example:
      unitvisor logs 3f2a9c --follow
    """
    with ctx.connect() as conn:
        run = load_run(conn, run_id)
        attempts = store.get_attempts(conn, run.id)
        records = store.get_outcome_records(conn, run.id)
    if attempt is not None:
        attempts = [a for a in attempts if a.attempt == attempt]
        if not attempts:
            raise Failure(f"run {run.id} has no attempt {attempt}")
    if not attempts:
        raise Failure(f"run {run.id} has not started yet ({run.state}); no output")
    here = ctx.settings.host_id
    mine = [a for a in attempts if a.host_id == here]
    elsewhere = sorted({a.host_id for a in attempts if a.host_id != here})
    # An attempt still running here has its output only in the journal; an ended one is shown from
    # the journal while it still has it.
    if mine and (any(a.outcome is None for a in mine) or Journal().has_output(str(run.id), attempt)):
        if elsewhere:
            click.echo(f"note: attempts of this run also ran on {', '.join(elsewhere)}; their output is there",
                       err=True)
        if attempt is None and not follow and len(mine) > 1:
            _print_journal_by_attempt(run.id, mine, lines)
            return
        cmd = log_command(str(run.id), attempt, follow, lines)
        try:
            os.execvp(cmd[0], cmd)
        except OSError as exc:
            raise Failure(f"cannot run journalctl: {exc.strerror}") from None
    _print_kept_output(run.id, attempts, records, here, follow, lines)


def _print_journal_by_attempt(run_id: uuid.UUID, attempts: list[Attempt], lines: int | None) -> None:
    """Each attempt's output from this host's journal under a header of its own, in journalctl's
    `-- ... --` style: one journalctl over them all runs their lines together, and a retry's first
    line would read as the failed attempt's last. --lines is per attempt then."""
    worst = 0
    for a in attempts:
        click.echo(f"-- attempt {a.attempt} of run {run_id} on host {a.host_id}: "
                   f"{a.outcome or 'no outcome yet'}{f' ({a.exit_status})' if a.exit_status else ''} --")
        sys.stdout.flush()  # before journalctl writes to the same stdout
        cmd = log_command(str(run_id), a.attempt, False, lines)
        try:
            worst = max(worst, subprocess.run(cmd, check=False).returncode)
        except OSError as exc:
            raise Failure(f"cannot run journalctl: {exc.strerror}") from None
    if worst:
        sys.exit(worst)


def _print_kept_output(run_id: uuid.UUID, attempts: list[Attempt], records: dict[int, OutcomeRecord], here: str,
                       follow: bool, lines: int | None) -> None:
    """`logs` where this host's journal does not have the output: the tails kept with the outcomes."""
    running = [a for a in attempts if a.outcome is None]
    if follow and running:
        a = running[-1]
        raise Failure(f"attempt {a.attempt} of run {run_id} runs on host {a.host_id}: run "
                      f"`{' '.join(log_command(str(run_id), a.attempt, True, None))}` there")
    kept = [(a, records[a.attempt].output_tail) for a in attempts
            if a.attempt in records and records[a.attempt].output_tail is not None]
    if not kept:
        command = " ".join(log_command(str(run_id), None, False, None))
        where = sorted({a.host_id for a in attempts})
        if here not in where:
            raise Failure(f"run {run_id} ran on host {', '.join(where)}, not on this host ({here}), and no output "
                          f"was kept with its outcomes: run `{command}` there")
        raise Failure(f"no output of run {run_id} in this host's journal, and none kept with its outcomes "
                      f"([runs] output_tail_lines): `{command}` shows what journald still has")
    for a, tail in kept:
        shown = tail.splitlines()
        if lines is not None:
            shown = shown[-lines:] if lines else []
        click.echo(f"attempt {a.attempt} on host {a.host_id}: the last {len(shown)} lines of its output, kept with "
                   "its outcome; the whole output is in that host's journal while it keeps it", err=True)
        if shown:
            click.echo("\n".join(shown))


@cli.command()
@click.argument("run_id", metavar="RUN")
@click.option("--timeout", callback=quantity(parse_duration, 1, 10**10, "1s to 115740d", "seconds"),
              help="Give up after this long, like 30s or 1h (exit 124).")
@pass_ctx
def wait(ctx: Context, run_id: str, timeout: float | None) -> None:
    """Wait until a run ends.

    \b
    Exit status:
      0    the run succeeded
      1    it failed, was cancelled, expired or skipped (or: no such run, bad configuration, no schema)
      124  --timeout passed first; the run goes on
      75   could not tell: the database was unreachable, or lost while waiting (EX_TEMPFAIL);
           the run may still be running or have ended: wait again
      2    bad usage

    \b
    Example:
      unitvisor wait 3f2a9c --timeout 10m && echo done
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        with ctx.connect() as conn:
            rid = resolve_run_id(conn, run_id)
            seen = False
            while True:
                # The status control planes read (unitvisor.run_status), so the two agree.
                run = store.run_status(conn, rid)
                if run is None:
                    raise Failure(f"run {rid} was deleted") if seen else no_run(conn, run_id)
                seen = True
                if run.state in TERMINAL_STATES:
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    click.echo(f"run {rid} is still {run.state}", err=True)
                    sys.exit(124)
                time.sleep(0.5)
    except Unreachable as exc:
        raise CouldNotTell(f"cannot tell how run {run_id} ends: {exc}") from None
    except store.CONNECTION_LOST as exc:
        raise CouldNotTell(f"cannot tell how run {run_id} ends: lost the database while waiting: "
                           f"{store.one_line(exc)}") from None
    click.echo(f"run {rid} {run.state}")
    sys.exit(0 if run.state == "succeeded" else 1)

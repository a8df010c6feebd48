"""The `unitvisor` command: parse, call one function, print. No SQL and no D-Bus here.

Conventions (as systemctl and git): tables for people, --json for scripts; exit 0 on success, 1 on
failure, 2 on bad usage; errors on stderr in one line, no traceback unless --debug.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import sys
import time
import uuid
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NoReturn

import click
import psycopg

from supervisor import __version__, config, fleet, store
from supervisor.journal import Journal, log_command
from supervisor.model import RUN_STATES, TERMINAL_STATES, Accounting, Attempt, OutcomeRecord, Run
from supervisor.quantities import (
    QuantityError,
    format_bytes,
    format_cpu_time,
    format_duration,
    format_size,
    parse_duration,
    parse_percent,
    parse_size,
    parse_time,
)

_RUN_ID_PREFIX_RE = re.compile(r"^[0-9a-f][0-9a-f-]{5,35}\Z")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}\Z")
MIN_MEMORY = 1 << 20


class Failure(click.ClickException):
    """A command that ran and failed: exit 1, one line on stderr."""

    exit_code = 1


class Unreachable(Failure):
    """The database cannot be reached (exit 1; `wait` turns it into WAIT_UNKNOWN)."""


# `unitvisor wait` exits 75 (sysexits' EX_TEMPFAIL, "try again later") when it could not tell how the
# run ended: the database was unreachable, or lost while waiting. The run's fate is unknown, not bad:
# it may still be running, or have succeeded, and waiting again is the cure. EX_TEMPFAIL says exactly
# that; 69 (EX_UNAVAILABLE) would name the cause but not the remedy. 1 stays "the run failed or was
# cancelled" and 124 "timed out", so a script never mistakes a database outage for either.
WAIT_UNKNOWN = 75


class CouldNotTell(Failure):
    exit_code = WAIT_UNKNOWN


# What main() must know before the command's own Context exists, or after it is gone: set by the
# --debug option wherever it was given (before or after the subcommand), never by a scan of argv,
# which would also see a run's own `--debug` after `--`.
_options: dict[str, Any] = {"debug": False, "command": ""}


class Context:
    def __init__(self, config_path: Path | None, dsn: str | None, debug: bool) -> None:
        self.config_path = config_path
        self.dsn_override = dsn
        self.debug = debug
        self._settings: config.Settings | None = None

    @property
    def settings(self) -> config.Settings:
        if self._settings is None:
            try:
                self._settings = config.load(self.config_path)
            except config.ConfigError as exc:
                raise Failure(str(exc)) from None
        return self._settings

    def dsn(self) -> str:
        try:
            return config.resolve_dsn(self.settings, self.dsn_override)
        except config.ConfigError as exc:
            raise Failure(str(exc)) from None

    def connect(self, schema: bool = True) -> store.Connection:
        """A connection to the database; with `schema`, one whose schema is current (else a Failure that
        says to run `unitvisor migrate`, instead of an UndefinedTable from the first query)."""
        dsn = self.dsn()
        try:
            conn = store.connect(dsn)
        except store.DatabaseUnavailable as exc:
            raise Unreachable(str(exc)) from None
        except store.DatabaseError as exc:
            raise Failure(str(exc)) from None
        if schema:
            try:
                _check_schema(conn, dsn)
            except BaseException:
                conn.close()
                raise
        return conn


def _check_schema(conn: store.Connection, dsn: str) -> None:
    pending = store.pending_migrations(conn)
    if not pending:
        return
    where = store.dsn_location(dsn)
    if len(pending) == len(store.migration_files()):
        raise Failure(f"the database at {where} has no unitvisor schema yet: run `unitvisor migrate`")
    raise Failure(f"the database at {where} lacks migration{'s' if len(pending) > 1 else ''} "
                  f"{', '.join(pending)}: run `unitvisor migrate`")


pass_ctx = click.make_pass_decorator(Context)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_path", type=click.Path(path_type=Path), default=None,
              help=f"Configuration file [default: {config.DEFAULT_PATH}].")
@click.option("--dsn", envvar="UNITVISOR_DSN", default=None,
              help="PostgreSQL connection string (also $UNITVISOR_DSN).")
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
@click.version_option(__version__, prog_name="unitvisor")
@click.pass_context
def cli(ctx: click.Context, config_path: Path | None, dsn: str | None, debug: bool) -> None:
    """unitvisor: run commands as limited, supervised systemd units, queued in PostgreSQL.

    --config, --dsn and --debug may also follow the command (`unitvisor runs --dsn ...`); there
    they win over the same option given before it. Nothing after `--` is read as an option.

    \b
    Example:
      unitvisor submit --memory 256M --cpu 50% -- /usr/bin/env echo hello
      unitvisor show 3f2a9c
    """
    _options["debug"] = _options["debug"] or debug
    _options["command"] = ctx.invoked_subcommand or ""
    ctx.obj = Context(config_path, dsn, debug)


# -- argument types -------------------------------------------------------------------------------


def _quantity(parse: Any, low: float, high: float, shown: str, unit: str) -> Any:
    """A human quantity within [low, high]. `shown` is the range as a person writes it ("1M to 4E"),
    `unit` what a bare number means ("bytes"): an error names both, so that `--memory 256` does not
    leave anyone guessing why 256 is too small."""
    def convert(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value is None:
            return None
        try:
            number = parse(value)
        except QuantityError as exc:
            raise click.BadParameter(f"{exc} (the range is {shown})") from None
        if not low <= number <= high:
            text = value.strip()
            bare = re.fullmatch(r"\d+(\.\d+)?", text) is not None
            detail = shown
            if bare and unit == "bytes" and number < low:
                detail += f"; a bare number is bytes, use {text}M"
            elif bare and unit == "bytes":
                detail += "; a bare number is bytes"
            amount = (text + ("" if unit == "%" else " ") + unit) if bare else text
            raise click.BadParameter(f"{amount} is out of range ({detail})")
        return number
    return convert


class _IntRange(click.IntRange):
    """click.IntRange (whose range the help shows), with an error in the CLI's words:
    `0 is out of range (1 to 4194304)`, the same in every click version."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = click.INT.convert(value, param, ctx)
        if (self.min is not None and number < self.min) or (self.max is not None and number > self.max):
            shown = f"at least {self.min}" if self.max is None else f"{self.min} to {self.max}"
            self.fail(f"{number} is out of range ({shown})", param, ctx)
        return number


def _split_pair(item: str, form: str) -> tuple[str, str]:
    """NAME=VALUE (or KEY=VALUE, as `form` says) split at its first '='."""
    name, sep, value = item.partition("=")
    if not sep:
        raise click.BadParameter(f"{item!r} has no '=': use {form}")
    return name, value


def _env_pairs(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in values:
        name, value = _split_pair(item, "NAME=VALUE")
        if not _ENV_NAME_RE.match(name):
            raise click.BadParameter(f"{name!r} is not a valid environment variable name")
        if "\n" in value or "\0" in value:
            raise click.BadParameter(f"the value of {name} contains a newline or NUL")
        env[name] = value
    return env


# A label as unitvisor.labels_are_valid accepts it (sql/005_sql_api.sql), checked here too so that a
# typo is a usage error that names the option.
_LABEL_KEY_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._/-]{0,61}[A-Za-z0-9])?")


def _label_pairs(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[str, str]:
    labels: dict[str, str] = {}
    for item in values:
        key, value = _split_pair(item, "KEY=VALUE")
        if not _LABEL_KEY_RE.fullmatch(key):
            raise click.BadParameter(f"{key!r} is not a label key (1 to 63 letters, digits, '.', '_', '-' and '/', "
                                     "starting and ending with a letter or digit)")
        if len(value) > 255 or any(ord(c) < 32 or ord(c) == 127 for c in value):
            raise click.BadParameter(f"the value of label {key} is over 255 characters or has a control character")
        labels[key] = value
    return labels


def _time(ctx: click.Context, param: click.Parameter, value: str | None) -> datetime | timedelta | None:
    """--not-before and --start-deadline: a time, or a duration from the database's now (resolved in
    submit, once connected)."""
    if value is None:
        return None
    try:
        return parse_time(value)
    except QuantityError as exc:
        raise click.BadParameter(str(exc)) from None


def _concurrency_key(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    # As unitvisor.submit_run checks it (runs_concurrency_key_valid), here too: a typo is a usage error.
    if value is not None and (not 1 <= len(value) <= 255 or any(ord(c) < 32 or ord(c) == 127 for c in value)):
        raise click.BadParameter("a concurrency key is 1 to 255 characters without control characters")
    return value


def _at(when: datetime | timedelta | None, now: datetime) -> datetime | None:
    return now + when if isinstance(when, timedelta) else when


def resolve_run_id(conn: store.Connection, text: str) -> uuid.UUID:
    """A full UUID, or a unique prefix of at least 6 characters."""
    candidate = text.strip().lower()
    try:
        return uuid.UUID(candidate) if len(candidate) >= 32 else _by_prefix(conn, text, candidate)
    except ValueError:
        return _by_prefix(conn, text, candidate)


def _by_prefix(conn: store.Connection, text: str, prefix: str) -> uuid.UUID:
    if not _RUN_ID_PREFIX_RE.match(prefix):
        raise click.UsageError(f"invalid run id {text!r}: expected a UUID or at least 6 of its first characters")
    found = store.find_run_ids(conn, prefix)
    if not found:
        raise Failure(f"no run with id {text}")
    if len(found) > 1:
        raise Failure(f"run id {text} is ambiguous: {', '.join(str(r) for r in found)}")
    return found[0]


def _load_run(conn: store.Connection, text: str) -> Run:
    run = store.get_run(conn, resolve_run_id(conn, text))
    if run is None:
        raise Failure(f"no run with id {text}")
    return run


# -- commands -------------------------------------------------------------------------------------


@cli.command()
@click.option("--memory", callback=_quantity(parse_size, MIN_MEMORY, 1 << 62, "1M to 4E", "bytes"),
              help="Memory limit (MemoryMax), like 512M or 2G; 1M to 4E. A bare number is bytes.")
@click.option("--memory-high", callback=_quantity(parse_size, MIN_MEMORY, 1 << 62, "1M to 4E", "bytes"),
              help="Memory throttle (MemoryHigh): over it the run is slowed and its memory reclaimed, not "
                   "killed; like 384M; at most --memory. A bare number is bytes.")
@click.option("--cpu", callback=_quantity(parse_percent, 1, 100000, "1% to 100000%", "%"),
              help="CPU quota, like 50% or 200% (two CPUs); 1% to 100000%.")
@click.option("--tasks", type=_IntRange(1, 4194304), help="Maximum number of tasks (TasksMax).")
@click.option("--io-weight", type=_IntRange(1, 10000), help="IO weight, 1 to 10000 (IOWeight).")
@click.option("--runtime", callback=_quantity(lambda v: int(parse_duration(v)), 1, 315360000, "1s to 3650d",
                                              "seconds"),
              help="Runtime limit, like 90s, 10m or 2h (1s to 3650d); the run is stopped after it.")
@click.option("--max-attempts", type=_IntRange(1, 1000), default=1, show_default=True,
              help="Attempts in all, the first included.")
@click.option("--env", "environment", multiple=True, callback=_env_pairs, metavar="NAME=VALUE",
              help="Environment variable (repeatable). Its value is on this command line, which other users of "
                   "this machine can see while it runs: submit secrets with unitvisor.submit_run instead.")
@click.option("--workdir", help="Working directory (absolute).")
@click.option("--user", "run_user", help="Run as this user (the host must allow it).")
@click.option("--host", "host_pin", help="Only this host id may run it.")
@click.option("--priority", type=_IntRange(-(2**31), 2**31 - 1), default=0, show_default=True,
              help="Higher runs first.")
@click.option("--private-network", is_flag=True,
              help="No network but the run's own loopback (PrivateNetwork=yes).")
@click.option("--label", "labels", multiple=True, callback=_label_pairs, metavar="KEY=VALUE",
              help="Tag the run (repeatable); find it again with `runs --label`.")
@click.option("--idempotency-key", metavar="KEY",
              help="Submit at most once per KEY: a repeated submit prints the first run's id and queues nothing.")
@click.option("--concurrency-key", metavar="KEY", callback=_concurrency_key,
              help="Never run beside another run with this KEY, on any host: runs with one KEY start one at a "
                   "time, in the order they were submitted.")
@click.option("--not-before", metavar="TIME", callback=_time,
              help="Start no earlier than TIME: ISO 8601 (2026-12-01T03:00Z; without an offset, local time) or "
                   "+DURATION from now by the database's clock (+10m).")
@click.option("--start-deadline", metavar="TIME", callback=_time,
              help="A run that has not started by TIME (as --not-before) ends as expired.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED, metavar="-- COMMAND [ARG]...")
@pass_ctx
def submit(ctx: Context, command: tuple[str, ...], **options: Any) -> None:
    """Queue a run; print its id.

    \b
    Example:
      unitvisor submit --memory 256M --cpu 50% --tasks 32 -- /bin/sh -c 'echo hi; exit 3'
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
    }
    with ctx.connect() as conn:
        # Only when a time is relative: then the database's clock, which decides when it is due, says
        # what "now" is.
        now = store.now(conn) if any(isinstance(options[k], timedelta) for k in ("not_before", "start_deadline")) \
            else None
        fields["not_before"] = _at(options["not_before"], now)
        fields["start_deadline"] = _at(options["start_deadline"], now)
        if fields["not_before"] and fields["start_deadline"] and fields["start_deadline"] <= fields["not_before"]:
            raise click.UsageError("--start-deadline: must be later than --not-before")
        try:
            run_id = store.submit_run(conn, **fields)
        except store.DatabaseError as exc:
            raise Failure(str(exc)) from None
    click.echo(str(run_id))


def _iso(value: datetime | None) -> str | None:
    return value.astimezone(UTC).isoformat() if value else None


def _attempt_json(attempt: Attempt, record: OutcomeRecord | None) -> dict[str, Any]:
    return {
        "attempt": attempt.attempt, "host": attempt.host_id, "unit": attempt.unit_name,
        "invocation_id": attempt.invocation_id, "claimed_at": _iso(attempt.claimed_at),
        "started_at": _iso(attempt.started_at), "ended_at": _iso(attempt.ended_at),
        "outcome": attempt.outcome, "exit_status": attempt.exit_status, "reason": attempt.reason,
        # systemd's and the kernel's raw figures (nanoseconds, bytes, tasks), null where not measured or
        # still running; for an ended attempt, what each null one needs that its host did not have
        "accounting": asdict(record.accounting if record else Accounting()),
        "not_measured": not_measured(record.accounting) if record else {},
        "output_tail": record.output_tail if record else None,
    }


def accounting_text(accounting: Accounting) -> str:
    """What systemd measured of an attempt, for people: "1.2s CPU, 34.0M peak memory, 1.0M read,
    0B written, 12 tasks at most"; a figure not measured is left out, "-" when none was."""
    parts = []
    if accounting.cpu_usage_nsec is not None:
        parts.append(f"{format_cpu_time(accounting.cpu_usage_nsec)} CPU")
    for value, what in ((accounting.memory_peak_bytes, "peak memory"), (accounting.io_read_bytes, "read"),
                        (accounting.io_write_bytes, "written")):
        if value is not None:
            parts.append(f"{format_bytes(value)} {what}")
    if accounting.tasks_peak is not None:
        parts.append(f"{accounting.tasks_peak} task{'' if accounting.tasks_peak == 1 else 's'} at most")
    return ", ".join(parts) or "-"


# Why an ended attempt's figure is NULL: what a host needs to measure it (docs/sql-api.md, Attempts).
# The same for every figure besides: an outcome recorded without the unit (a reboot, a dead host's
# attempt taken over) has none.
NOT_MEASURED_WHY = {
    "cpu_usage_nsec": "needs the cgroup's CPU accounting (cgroup v2, or v1's cpuacct)",
    "memory_peak_bytes": "needs systemd 256 or later on cgroup v2 (MemoryPeak)",
    "io_read_bytes": "needs cgroup v2 with the io controller (IOReadBytes)",
    "io_write_bytes": "needs cgroup v2 with the io controller (IOWriteBytes)",
    "tasks_peak": "needs cgroup v2 on Linux 6.1 or later (pids.peak) and a daemon newer than 0.6.0",
}
NOT_MEASURED_TEXT = {"cpu_usage_nsec": "CPU", "memory_peak_bytes": "peak memory", "io_read_bytes": "read",
                     "io_write_bytes": "written", "tasks_peak": "peak tasks"}


def not_measured(accounting: Accounting) -> dict[str, str]:
    """An ended attempt's figures that its host could not know (NULL), each with what it would need."""
    return {name: why for name, why in NOT_MEASURED_WHY.items() if getattr(accounting, name) is None}


def not_measured_text(missing: dict[str, str]) -> str:
    """`show`'s line: "peak memory (needs systemd 256 ...); peak tasks (...)"."""
    return "; ".join(f"{NOT_MEASURED_TEXT[name]} ({why})" for name, why in missing.items())


def run_json(run: Run, attempts: list[Attempt], events: list[dict[str, Any]],
             records: dict[int, OutcomeRecord] | None = None) -> dict[str, Any]:
    data = asdict(run)
    return {
        "id": str(run.id), "state": run.state, "argv": run.argv, "environment": run.environment,
        "working_directory": run.working_directory, "user": run.run_user, "host_pin": run.host_pin,
        "priority": run.priority, "private_network": run.private_network, "labels": run.labels,
        "concurrency_key": run.concurrency_key, "not_before": _iso(run.not_before),
        "start_deadline": _iso(run.start_deadline),
        "limits": {key: data[key] for key in
                   ("memory_max", "memory_high", "cpu_quota_percent", "tasks_max", "io_weight", "runtime_max_sec")},
        "max_attempts": run.max_attempts, "cancel_requested_at": _iso(run.cancel_requested_at),
        "wait_reason": run.wait_reason if run.state == "queued" else None,
        "created_at": _iso(run.created_at), "finished_at": _iso(run.finished_at),
        "attempts": [_attempt_json(a, (records or {}).get(a.attempt)) for a in attempts],
        "events": [{"at": _iso(e["at"]), "attempt": e["attempt"], "host": e["host_id"], "state": e["state"],
                    "reason": e["reason"]} for e in events],
        "logs_command": " ".join(log_command(str(run.id), None, False, None)),
    }


# What `show` says of a run's network: the row's own choice; a host may still take it away from all.
NETWORK_TEXT = {True: "none but loopback (--private-network)",
                False: "the host's, unless the host's [runs] private_network is true"}


@cli.command()
@click.argument("run_id", metavar="RUN")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def show(ctx: Context, run_id: str, as_json: bool) -> None:
    """Show a run, its limits, attempts and recent events.

    \b
    Example:
      unitvisor show 3f2a9c --json
    """
    with ctx.connect() as conn:
        run = _load_run(conn, run_id)
        data = run_json(run, store.get_attempts(conn, run.id), store.get_events(conn, run.id),
                        store.get_outcome_records(conn, run.id))
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
    lines += [
        f"  command:   {_command_text(run.argv)}",
        f"  limits:    memory={format_size(limits['memory_max'])} memory-high={format_size(limits['memory_high'])} cpu="
        f"{str(limits['cpu_quota_percent']) + '%' if limits['cpu_quota_percent'] else '-'} "
        f"tasks={limits['tasks_max'] or '-'} io-weight={limits['io_weight'] or '-'} "
        f"runtime={format_duration(limits['runtime_max_sec'])}",
        f"  network:   {NETWORK_TEXT[run.private_network]}",
        f"  labels:    {' '.join(f'{k}={v}' for k, v in sorted(run.labels.items())) or '-'}",
    ]
    start = [f"{name} {data[key]}" for name, key in (("concurrency key", "concurrency_key"),
                                                     ("not before", "not_before"),
                                                     ("start deadline", "start_deadline")) if data[key]]
    if start:
        lines.append(f"  start:     {'; '.join(start)}")
    lines.append(f"  attempts:  {len(data['attempts'])} of {run.max_attempts}")
    for a in data["attempts"]:
        lines.append(f"  attempt {a['attempt']}: host={a['host']} unit={a['unit']} outcome={a['outcome'] or '-'} "
                     f"exit={a['exit_status'] or '-'} started={a['started_at'] or '-'} ended={a['ended_at'] or '-'}")
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


def _command_text(argv: list[str]) -> str:
    return shlex.join(argv)


@cli.command()
@click.option("--state", "states", multiple=True, type=click.Choice(RUN_STATES),
              help="Only runs in this state (repeatable).")
@click.option("--host", help="Only runs whose latest attempt is on this host.")
@click.option("--since", callback=_quantity(parse_duration, 1, 10**10, "1s to 115740d", "seconds"),
              help="Only runs created this recently, like 1h.")
@click.option("--label", "labels", multiple=True, callback=_label_pairs, metavar="KEY=VALUE",
              help="Only runs with this label (repeatable: all of them).")
@click.option("--limit", type=_IntRange(1, 100000), default=50, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def runs(ctx: Context, states: tuple[str, ...], host: str | None, since: float | None, labels: dict[str, str],
         limit: int, as_json: bool) -> None:
    """List runs, newest first.

    \b
    Example:
      unitvisor runs --state running --since 1h
    """
    with ctx.connect() as conn:
        rows = store.list_runs(conn, states, host, timedelta(seconds=since) if since else None, limit, labels)
        now = store.now(conn)
    if as_json:
        click.echo(json.dumps([{
            "id": str(r["id"]), "state": r["state"], "host": r["host_id"], "attempt": r["attempt"],
            "created_at": _iso(r["created_at"]), "started_at": _iso(r["started_at"]), "ended_at": _iso(r["ended_at"]),
            "outcome": r["outcome"], "exit_status": r["exit_status"], "argv": r["argv"], "labels": r["labels"],
            "concurrency_key": r["concurrency_key"], "not_before": _iso(r["not_before"]),
            "start_deadline": _iso(r["start_deadline"]),
        } for r in rows], indent=2))
        return
    table = [("ID", "STATE", "HOST", "ATTEMPT", "AGE", "DURATION", "OUTCOME", "COMMAND")]
    for r in rows:
        duration = None
        if r["started_at"]:
            duration = ((r["ended_at"] or now) - r["started_at"]).total_seconds()
        table.append((str(r["id"])[:8], _state(r["state"]), r["host_id"] or "-", str(r["attempt"] or "-"),
                      format_duration((now - r["created_at"]).total_seconds()), format_duration(duration),
                      r["outcome"] or "-", _command_text(r["argv"])[:60]))
    _print_table(table)


_COLOURS = {"succeeded": "green", "ok": "green", "active": "green", "running": "cyan", "starting": "cyan",
            "queued": "blue", "failed": "red", "fail": "red", "cancelled": "yellow", "expired": "yellow",
            "warn": "yellow",
            "draining": "yellow", "stopped": "bright_black", "dead": "red"}


def _colour_wanted() -> bool:
    return "NO_COLOR" not in os.environ and sys.stdout.isatty()


class _Styled(str):
    """A table cell whose width is its text's, not its escape codes'."""

    plain: str

    def __new__(cls, text: str, styled: str) -> _Styled:
        obj = super().__new__(cls, styled)
        obj.plain = text
        return obj


def _state(state: str, text: str | None = None) -> str:
    text = text if text is not None else state
    if not _colour_wanted() or state not in _COLOURS:
        return text
    return _Styled(text, click.style(text, fg=_COLOURS[state]))


def _print_table(rows: list[tuple[str, ...]]) -> None:
    def width(cell: str) -> int:
        return len(cell.plain) if isinstance(cell, _Styled) else len(cell)

    widths = [max(width(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(cell + " " * (w - width(cell)) for cell, w in zip(row, widths, strict=True)).rstrip())


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
        raise Failure(f"no run with id {run_id}")
    if not result.changed:
        raise Failure(refused.format(id=rid, state=result.state))
    return rid, result


@cli.command()
@click.argument("run_id", metavar="RUN")
@pass_ctx
def resume(ctx: Context, run_id: str) -> None:
    """Reopen a failed or cancelled run: a new attempt with the command and limits its row has now.

    The run is queued again at once. Its attempts are numbered on from the last one, and a failed
    attempt is retried only while its number is below the run's --max-attempts. So a run that made N
    attempts of M gets max(1, M - N) more: one that used them all gets exactly one (if it fails, the
    run fails again at once: resume it again for another), one cancelled or failed earlier gets the
    attempts it had left. Earlier attempts and their outcomes are kept; a pending cancel is cleared.

    \b
    Example:
      unitvisor resume 3f2a9c
    """
    rid, _ = _transition(ctx, run_id, store.resume_run,
                         "run {id} is {state}; only a failed or cancelled run can be resumed")
    click.echo(f"run {rid} queued again")


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
    _print_table(rows)


@cli.command()
@click.argument("run_id", metavar="RUN")
@click.option("--attempt", type=_IntRange(1), help="Only this attempt [default: all].")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new output.")
@click.option("--lines", "-n", type=_IntRange(0), help="Only the last N lines.")
@pass_ctx
def logs(ctx: Context, run_id: str, attempt: int | None, follow: bool, lines: int | None) -> None:
    """Show a run's output from journald, also long after its unit is gone.

    The whole output lives in the journal of the host that ran the attempt, and is shown from there.
    Elsewhere (another host, or after that journal rotated or the host died) it shows the last lines
    kept with each ended attempt's outcome ([runs] output_tail_lines on the host that ran it),
    saying so on stderr.

    \b
    Example:
      unitvisor logs 3f2a9c --follow
    """
    with ctx.connect() as conn:
        run = _load_run(conn, run_id)
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
        cmd = log_command(str(run.id), attempt, follow, lines)
        try:
            os.execvp(cmd[0], cmd)
        except OSError as exc:
            raise Failure(f"cannot run journalctl: {exc.strerror}") from None
    _print_kept_output(run.id, attempts, records, here, follow, lines)


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
@click.option("--timeout", callback=_quantity(parse_duration, 1, 10**10, "1s to 115740d", "seconds"),
              help="Give up after this long, like 30s or 1h (exit 124).")
@pass_ctx
def wait(ctx: Context, run_id: str, timeout: float | None) -> None:
    """Wait until a run ends.

    \b
    Exit status:
      0    the run succeeded
      1    it failed, was cancelled or expired (or: no such run, bad configuration, no schema)
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
            while True:
                # The status control planes read (unitvisor.run_status), so the two agree.
                run = store.run_status(conn, rid)
                if run is None:
                    raise Failure(f"run {rid} was deleted")
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


# The metavar spelled out: click 8.1 would print `COMMAND [ARGS]...` (as if a subcommand were required),
# 8.2 and newer `[COMMAND] [ARGS]...`; docs/cli.md must read the same under both.
@cli.group(invoke_without_command=True, subcommand_metavar="[COMMAND] [ARGS]...")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def hosts(click_ctx: click.Context, as_json: bool) -> None:
    """List hosts: state, heartbeat age, capacity, runs in flight and admission by pressure.

    STATE is active, draining, stopped or dead; `(stale)` once a host missed two heartbeats (before
    the fleet declares it dead), `(conflict)` while a second daemon with its id is being refused.
    ADMISSION is what the host claims by the pressure of its runs' slice ([host] pressure_slow_at,
    pressure_stop_at): open, slowed (fewer), stopped (none) or off (PSI not read), with the figure
    that decided; `-` for a daemon that does not report it.

    \b
    Example:
      unitvisor hosts
      unitvisor hosts forget web-7
    """
    if click_ctx.invoked_subcommand is not None:
        _options["command"] = f"hosts {click_ctx.invoked_subcommand}"
        return
    ctx: Context = click_ctx.obj
    with ctx.connect() as conn:
        rows = store.list_hosts(conn)
    if as_json:
        click.echo(json.dumps([{
            "id": r["id"], "name": r["name"], "state": r["state"], "display_state": fleet.host_display_state(r),
            "max_runs": r["max_runs"], "memory_budget": r["memory_budget"], "version": r["version"],
            "started_at": _iso(r["started_at"]), "heartbeat_at": _iso(r["heartbeat_at"]),
            "heartbeat_age_seconds": round(r["heartbeat_age"], 3), "in_flight": r["in_flight"],
            "epoch": r["epoch"], "instance": r["instance"], "can_start": r["can_start"],
            "cannot_start_reason": r["cannot_start_reason"], "allowed_executables": r["allowed_executables"],
            "run_user": r["run_user"], "allowed_users": r["allowed_users"],
            "poll_interval_seconds": r["poll_interval_sec"], "host_dead_after_seconds": r["dead_after_sec"],
            "dead_at": _iso(r["dead_at"]), "dead_reason": r["dead_reason"],
            "conflict": r["conflict_detail"] if "conflict" in fleet.host_display_state(r) else None,
            "pressure": _pressure_json(r),
        } for r in rows], indent=2))
        return
    table = [("HOST", "NAME", "STATE", "HEARTBEAT", "RUNS", "MAX", "MEMORY BUDGET", "ADMISSION", "VERSION")]
    notes = []
    for r in rows:
        shown = fleet.host_display_state(r)
        table.append((r["id"], r["name"], _state(r["state"], shown), format_duration(r["heartbeat_age"]) + " ago",
                      str(r["in_flight"]), str(r["max_runs"]), format_size(r["memory_budget"]), _admission(r),
                      r["version"] or "-"))
        if r["state"] == "dead" and r["dead_reason"]:
            notes.append(f"{r['id']}: dead: {r['dead_reason']}")
        if "conflict" in shown:
            notes.append(f"{r['id']}: conflict: {r['conflict_detail']}")
        if not r["can_start"]:
            notes.append(f"{r['id']}: claims nothing: {r['cannot_start_reason']}")
        pressure_said = _pressure_json(r)
        if pressure_said and pressure_said["state"] != "open" and pressure_said["detail"]:
            notes.append(f"{r['id']}: {pressure_said['detail']}")
    _print_table(table)
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
@pass_ctx
def forget(ctx: Context, host: str) -> None:
    """Remove a dead (or stopped) host from the database once none of its runs is open.

    \b
    Example:
      unitvisor hosts forget web-7
    """
    with ctx.connect() as conn:
        state, open_count = store.forget_host(conn, host)
    if state is None:
        raise Failure(f"no host {host} (see `unitvisor hosts`)")
    if open_count:
        raise Failure(f"host {host} still has {open_count} open attempt(s); they are taken over once it is "
                      "declared dead")
    if state not in ("dead", "stopped"):
        raise Failure(f"host {host} is {state}: only a dead or stopped host can be forgotten (drain and stop it first)")
    click.echo(f"host {host} forgotten")


@hosts.command("add")
@click.argument("name")
@click.option("--role", "role_name", metavar="ROLE",
              help="The login role to create [default: unitvisor_host_NAME, lowercase, other characters as _].")
@click.option("--new-password", is_flag=True,
              help="Give the role already bound to NAME a new password (the old one stops working).")
@click.option("--connection-limit", type=click.IntRange(1, 10000), metavar="N",
              help=f"How many sessions the role may hold at once [default: {store.DEFAULT_HOST_CONNECTION_LIMIT} for "
                   "a new role; with --new-password, unchanged unless given].")
@click.option("--force", is_flag=True,
              help="With --new-password: rotate even while NAME's daemon is live (it is locked out at its next "
                   "reconnect until its /etc/unitvisor/dsn has the new password).")
@click.option("--db-host", metavar="HOST",
              help="The database server the printed DSN names [default: the one this command connects to], "
                   "e.g. when this command comes in over the local socket.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def add(ctx: Context, name: str, role_name: str | None, new_password: bool, connection_limit: int | None,
        force: bool, db_host: str | None, as_json: bool) -> None:
    """Give host NAME its own database role, bound to the host id NAME.

    Creates a login role with a random password, a member of unitvisor_host, bound to NAME, in one
    transaction, and prints what goes in that host's /etc/unitvisor/dsn (this command's DSN with
    that role and password, which are shown only now) and the [host] id for its config. The host's
    daemon may then act only as NAME. Needs unitvisor_admin and the right to create roles (a
    superuser, or CREATEROLE). A NAME that has a role already is an error (exit 1); --new-password
    rotates its password. The role may hold --connection-limit sessions at once: the daemon needs one,
    and a moment after a lost network up to two more, plus one per command run with its DSN. A live
    daemon keeps its session, but is locked out at its next reconnect until its DSN file has the new
    password (it reads the file again before each attempt, no restart needed); so --new-password
    refuses while NAME is live (heartbeat within its host_dead_after) unless --force.

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
                                connection_limit or store.DEFAULT_HOST_CONNECTION_LIMIT)
    host_dsn = store.dsn_for_role(dsn, role, password, db_host)
    config_lines = f'[host]\nid = "{_toml_string(name)}"'
    if as_json:
        click.echo(json.dumps({"host_id": name, "role": role, "dsn": host_dsn, "config": config_lines,
                               "new_password": new_password}, indent=2))
        return
    click.echo(f"# host {name}: role {role}" + (" has a new password" if new_password else " created and bound"))
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
    with ctx.connect() as conn:
        before = store.set_host_state(conn, host, state)
    if before is None:
        raise Failure(f"no host {host} (see `unitvisor hosts`)")
    if before == state:
        click.echo(f"host {host} is already {state}")
    else:
        click.echo(f"host {host}: {before} -> {state}")


@cli.command()
@click.argument("host", required=False)
@pass_ctx
def drain(ctx: Context, host: str | None) -> None:
    """Stop a host from claiming new runs; its runs finish. [default HOST: this one]

    The daemon sees it at its next heartbeat.

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

    \b
    Example:
      unitvisor undrain web-7
    """
    _set_host_state(ctx, host, "active")


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
    checks = run_checks(ctx.config_path, ctx.dsn_override)
    width = max(len(c.name) for c in checks)
    for check in checks:
        click.echo(f"{_state(check.status, check.status.ljust(4))}  {check.name.ljust(width)}  {check.message}")
    if any(c.status == "fail" for c in checks):
        sys.exit(1)


# How long `prune` waits for a daemon's batch (or another prune) to let go of the lock before it says so.
PRUNE_BUSY_WAIT = 60.0


@cli.command()
@click.option("--older-than", required=True, metavar="DURATION",
              callback=_quantity(parse_duration, 1, 10**10, "1s to 115740d", "seconds"),
              help="Delete runs finished longer ago than this, like 30d.")
@click.option("--dry-run", is_flag=True, help="Count what would be deleted, and delete nothing.")
@click.option("--batch-size", type=_IntRange(1, 100000), default=1000, show_default=True,
              help="Runs deleted per transaction.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pass_ctx
def prune(ctx: Context, older_than: float, dry_run: bool, batch_size: int, as_json: bool) -> None:
    """Delete finished runs older than --older-than, with their attempts, events and spawn jobs.

    Also claimed and discarded spawn jobs of that age of runs that are kept. A run that is queued,
    starting or running, or has an attempt without an outcome, is never deleted. Each batch commits
    on its own; an interrupted prune keeps what it deleted. The daemons do the same by themselves
    ([retention] in the config). Needs unitvisor_admin.

    \b
    Example:
      unitvisor prune --older-than 30d --dry-run
    """
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
    sys.exit(Daemon(settings, lambda: config.resolve_dsn(settings, ctx.dsn_override)).run())


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


# -- global options after the subcommand ---------------------------------------------------------
#
# `unitvisor runs --dsn X` works as `unitvisor --dsn X runs` does: every command carries hidden copies
# of the group's --config, --dsn and --debug, whose callbacks write into the one Context (made by the
# group's callback, which click runs before it parses the subcommand's arguments). Click parses them
# as the command's own options, so `--` ends them as it ends any option: a run's command after it
# (`submit -- /bin/sh -c ... --dsn x --debug`) is never read. The copies have no $UNITVISOR_DSN: the
# environment must not override a --dsn given before the command.


def _global_option_callback(attribute: str) -> Any:
    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value is None or value is False:
            return value
        obj = ctx.find_object(Context)
        if obj is not None:
            setattr(obj, attribute, value)
        if attribute == "debug":
            _options["debug"] = True
        return value
    return callback


def _global_options() -> list[click.Option]:
    return [
        click.Option(["--config", "global_config"], type=click.Path(path_type=Path), hidden=True,
                     expose_value=False, callback=_global_option_callback("config_path")),
        click.Option(["--dsn", "global_dsn"], hidden=True, expose_value=False,
                     callback=_global_option_callback("dsn_override")),
        click.Option(["--debug", "global_debug"], is_flag=True, hidden=True, expose_value=False,
                     callback=_global_option_callback("debug")),
    ]


def _add_global_options(group: click.Group) -> None:
    for command in group.commands.values():
        command.params.extend(_global_options())
        if isinstance(command, click.Group):
            _add_global_options(command)


_add_global_options(cli)


def _fail(message: str, code: int) -> NoReturn:
    click.echo(f"unitvisor: {' '.join(message.split())}", err=True)
    sys.exit(code)


def _usage_message(exc: click.UsageError) -> str:
    """`--memory: 256 bytes is out of range (...)`: a bad option's value names the option first."""
    if (isinstance(exc, click.BadParameter) and not isinstance(exc, click.MissingParameter)
            and isinstance(exc.param, click.Option) and exc.param.opts):
        return f"{max(exc.param.opts, key=len)}: {exc.message}"
    return exc.format_message()


# PostgreSQL's "undefined table / function / schema": a schema that is missing or behind. The CLI
# checks the schema when it connects; this covers whatever slips past that check.
_SCHEMA_SQLSTATES = {"42P01", "42883", "3F000"}


# insufficient_privilege: PostgreSQL's own refusals and unitvisor.require_host's (sql/004_roles.sql).
_DENIED_SQLSTATE = "42501"
_SUBMITTER = "unitvisor_submitter or unitvisor_admin (a control plane's or the admin's role)"
_ADMIN = "unitvisor_admin"
_HOST = "the role bound to this host's id (unitvisor hosts add) or unitvisor_admin"
# The role each command needs, for the one line that says why the database refused it.
_NEEDED_ROLE = {
    "submit": _SUBMITTER, "cancel": _SUBMITTER, "resume": _SUBMITTER,
    "drain": _ADMIN, "undrain": _ADMIN, "hosts forget": _ADMIN, "prune": _ADMIN,
    "hosts add": "unitvisor_admin and the right to create roles (a superuser, or CREATEROLE)",
    "migrate": "a role that may create roles (a superuser, or CREATEROLE) for migration 004, then unitvisor_admin",
    "daemon": _HOST, "reconcile": _HOST,
}


def main() -> None:
    _options["debug"] = False
    try:
        cli.main(prog_name="unitvisor", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.Abort:
        _fail("aborted", 1)
    except click.UsageError as exc:
        # Never a traceback, --debug or not: the parser's stack says nothing about the mistake.
        _fail(f"{_usage_message(exc)}; see '{exc.ctx.command_path if exc.ctx else 'unitvisor'} --help'", 2)
    except click.ClickException as exc:
        if _options["debug"]:
            raise
        _fail(exc.format_message(), exc.exit_code)
    except store.DatabaseError as exc:
        if _options["debug"]:
            raise
        _fail(str(exc), 1)
    except psycopg.Error as exc:
        if _options["debug"]:
            raise
        if exc.sqlstate == _DENIED_SQLSTATE:
            command = _options["command"]
            _fail(f"the database refused `unitvisor {command}` to this role ({store.one_line(exc)}): it needs "
                  f"{_NEEDED_ROLE.get(command, 'a role allowed to (README, Roles: who may do what)')}", 1)
        if exc.sqlstate in _SCHEMA_SQLSTATES:
            _fail(f"the database schema is missing or behind ({store.one_line(exc)}): run `unitvisor migrate`", 1)
        _fail(f"database error: {store.one_line(exc)}", 1)
    except Exception as exc:  # the last line of defence: one line, not a traceback
        if _options["debug"]:
            raise
        _fail(f"internal error: {type(exc).__name__}: {exc} (run with --debug for details)", 1)

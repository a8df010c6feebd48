"""How the commands print: tables with coloured states for people, JSON for scripts, and a run as
both (`show`)."""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

import click

from supervisor import stopsignals
from supervisor.journal import log_command
from supervisor.model import TERMINAL_STATES, Accounting, Attempt, OutcomeRecord, Run
from supervisor.quantities import format_bytes, format_cpu_time


def iso(value: datetime | None) -> str | None:
    return value.astimezone(UTC).isoformat() if value else None


def _attempt_json(attempt: Attempt, record: OutcomeRecord | None) -> dict[str, Any]:
    return {
        "attempt": attempt.attempt, "host": attempt.host_id, "unit": attempt.unit_name,
        "invocation_id": attempt.invocation_id, "claimed_at": iso(attempt.claimed_at),
        "started_at": iso(attempt.started_at), "ended_at": iso(attempt.ended_at),
        "outcome": attempt.outcome, "exit_status": attempt.exit_status, "reason": attempt.reason,
        # systemd's and the kernel's raw figures (nanoseconds, bytes, tasks), null where not measured or
        # still running; for an ended attempt, what each null one needs that its host did not have
        "accounting": asdict(record.accounting if record else Accounting()),
        "not_measured": not_measured(record.accounting) if record else {},
        "output_tail": record.output_tail if record else None,
        "warned_at": iso(attempt.warned_at),  # when its host sent the run's warn_signal (schema 026)
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


def wait_text(recorded: str | None, refused: str | None) -> str | None:
    """Why a queued run waits: what explain_waiting recorded (its not_before, the run of its
    concurrency key, why no host took it), and why no live host accepts it now (refusals_now), which
    explain_waiting records only once the run has waited two poll intervals; each said once."""
    parts = [recorded] if recorded else []
    if refused and refused not in (recorded or ""):
        parts.append(refused)
    return "; ".join(parts) or None


def state_phrase(state: str) -> str:
    """"is running", but "succeeded" (not "is succeeded"): the ended states read as verbs."""
    return state if state in TERMINAL_STATES else f"is {state}"


def attempts_text(made: int, max_attempts: int) -> str:
    """`show`'s attempts line. Resume numbers on past --max-attempts (README, Resume and the attempt
    budget), where "3 of 2" would read as a count gone wrong."""
    if made <= max_attempts:
        return f"{made} of {max_attempts}"
    return f"{made} ({max_attempts} by --max-attempts, {made - max_attempts} more by resume)"


def label_text(labels: dict[str, str]) -> str:
    """Labels as `show` and `hosts` print them: KEY=VALUE, sorted, space-separated; `-` for none."""
    return " ".join(f"{k}={v}" for k, v in sorted(labels.items())) or "-"


# --avoid-failed-host's words for avoid_failed_host's three values (schema 033); lost is NULL, the default.
AVOID_FAILED_HOST: dict[str, bool | None] = {"lost": None, "any": True, "never": False}
# The three, as `show` says them.
AVOID_TEXT = {None: "a retry after a lost attempt prefers another host",
              True: "a retry after any failed attempt prefers another host",
              False: "a retry may go back to the host it failed on"}


def placement_text(run: Run) -> str:
    """show's placement line: the labels a host must have, and where a retry goes."""
    needs = f"hosts with {label_text(run.host_labels)}; " if run.host_labels else ""
    return needs + AVOID_TEXT[run.avoid_failed_host]


def run_json(run: Run, attempts: list[Attempt], events: list[dict[str, Any]],
             records: dict[int, OutcomeRecord] | None = None, refused: str | None = None) -> dict[str, Any]:
    data = asdict(run)
    return {
        "id": str(run.id), "state": run.state, "argv": run.argv, "environment": run.environment,
        "working_directory": run.working_directory, "user": run.run_user, "host_pin": run.host_pin,
        "priority": run.priority, "private_network": run.private_network, "labels": run.labels,
        # Placement (schema 033): avoid_failed_host null means after a lost attempt only.
        "host_labels": run.host_labels, "avoid_failed_host": run.avoid_failed_host,
        "concurrency_key": run.concurrency_key, "concurrency_limit": run.concurrency_limit,
        "not_before": iso(run.not_before), "start_deadline": iso(run.start_deadline),
        "limits": {key: data[key] for key in
                   ("memory_max", "memory_high", "cpu_quota_percent", "tasks_max", "io_weight", "runtime_max_sec")},
        # Graceful stop (schema 026): the signal in effect (TERM unless the run names one); stop_timeout
        # null: its host's [systemd] stop_grace; warn_before null: no warning.
        "stop": {"stop_signal": stopsignals.stop_signal(run), "stop_timeout": run.stop_timeout,
                 "warn_before": run.warn_before,
                 "warn_signal": run.warn_signal if run.warn_before is None
                 else stopsignals.short_name(run.warn_signal or stopsignals.DEFAULT_WARN_SIGNAL)},
        "max_attempts": run.max_attempts, "cancel_requested_at": iso(run.cancel_requested_at),
        "wait_reason": wait_text(run.wait_reason, refused) if run.state == "queued" else None,
        "no_host_accepts": refused if run.state == "queued" else None,
        "created_at": iso(run.created_at), "finished_at": iso(run.finished_at),
        "attempts": [_attempt_json(a, (records or {}).get(a.attempt)) for a in attempts],
        "events": [{"at": iso(e["at"]), "attempt": e["attempt"], "host": e["host_id"], "state": e["state"],
                    "reason": e["reason"]} for e in events],
        "logs_command": " ".join(log_command(str(run.id), None, False, None)),
    }


def command_text(argv: list[str], width: int | None = None) -> str:
    """The command as a shell would take it; with `width`, cut at a word and ended with an ellipsis
    when longer (cut mid-word and unmarked, `/usr/bin/pyt` reads as a real path)."""
    text = shlex.join(argv)
    if width is None or len(text) <= width:
        return text
    cut = text[:width - 1]
    space = cut.rfind(" ")
    return (cut[:space] if space > 0 else cut) + "…"


_COLOURS = {"succeeded": "green", "ok": "green", "active": "green", "running": "cyan", "starting": "cyan",
            "queued": "blue", "failed": "red", "fail": "red", "cancelled": "yellow", "expired": "yellow",
            "skipped": "yellow", "warn": "yellow",
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


def state_cell(state: str, text: str | None = None) -> str:
    text = text if text is not None else state
    if not _colour_wanted() or state not in _COLOURS:
        return text
    return _Styled(text, click.style(text, fg=_COLOURS[state]))


def print_table(rows: list[tuple[str, ...]]) -> None:
    def width(cell: str) -> int:
        return len(cell.plain) if isinstance(cell, _Styled) else len(cell)

    widths = [max(width(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(cell + " " * (w - width(cell)) for cell, w in zip(row, widths, strict=True)).rstrip())


"""Failure rules in the CLI (issue 25, item 3; sql/migrations/027_failure_rules.sql): `submit`'s
--retry-on, --fail-on, --count-lost and --max-lost-attempts, and what `show` says of them.

A module of its own so that submit and show each gain one call: the rules themselves are the
database's (unitvisor.failure_verdict), which checks every value and refuses a bad one by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from supervisor.cli.params import IntRange
from supervisor.model import Attempt, Run


def failure_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """submit's options for the failure rules, in one block."""
    options = [
        click.option("--retry-on", "retry_on", multiple=True, metavar="RULE",
                     help="Retry only after this (repeatable): an outcome (exit-code, signal, core-dump, timeout, "
                          "oom-kill, watchdog, start-failed, lost), an exit status (exit:75) or a signal "
                          "(signal:TERM). Without it, every failure is retried, within --max-attempts."),
        click.option("--fail-on", "fail_on", multiple=True, metavar="CODE",
                     help="End the run at once, attempts left or not, after this exit status (exit:3) or signal "
                          "(signal:KILL) (repeatable); it wins over --retry-on's outcomes."),
        click.option("--count-lost", is_flag=True,
                     help="An attempt lost with its host (a dead host, a reboot) counts against --max-attempts; "
                          "by default it does not."),
        click.option("--max-lost-attempts", type=IntRange(1, 1000), metavar="N",
                     help="End the run after this many attempts lost with their host (when they do not count); "
                          "default 3."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def failure_fields(options: dict[str, Any]) -> dict[str, Any]:
    """submit_run's arguments, only those asked for: a database before schema 027 still takes a run
    that asks for none of them."""
    return {"retry_on": list(options["retry_on"]) or None, "fail_on": list(options["fail_on"]) or None,
            "count_lost": True if options["count_lost"] else None,
            "max_lost_attempts": options["max_lost_attempts"]}


def uncounted(run: Run, attempt: Attempt) -> bool:
    """Whether this attempt is one max_attempts does not count: lost with its host, count_lost off."""
    return attempt.outcome == "lost" and not run.count_lost


def failure_json(run: Run, attempts: list[Attempt]) -> dict[str, Any]:
    """show --json: the run's rules, and which attempts count against max_attempts."""
    return {"retry_on": run.retry_on, "fail_on": run.fail_on, "count_lost": run.count_lost,
            "max_lost_attempts": run.max_lost_attempts,
            "uncounted_attempts": [a.attempt for a in attempts if uncounted(run, a)]}


def attempts_line(run: Run, attempts: list[Attempt], plain: str) -> str:
    """show's attempts line: `plain` (attempts_text's), or with lost attempts that did not count, how
    many counted and how many were lost of the cap."""
    lost = sum(1 for a in attempts if uncounted(run, a))
    if not lost:
        return plain
    return (f"{len(attempts)}: {len(attempts) - lost} of {run.max_attempts} counted, {lost} lost with their host "
            f"not counted (at most {run.max_lost_attempts})")


def attempt_label(run: Run, attempt: Attempt) -> str:
    """`attempt 3` or `attempt 3 (lost with host web-2, not counted)`."""
    if uncounted(run, attempt):
        return f"attempt {attempt.attempt} (lost with host {attempt.host_id}, not counted)"
    return f"attempt {attempt.attempt}"


def rules_line(run: Run) -> str | None:
    """show's line of the run's failure rules, None when it has the defaults."""
    parts = []
    if run.retry_on is not None:
        parts.append(f"retry on {', '.join(run.retry_on) or 'nothing'}")
    if run.fail_on:
        parts.append(f"fail on {', '.join(run.fail_on)}")
    if run.count_lost:
        parts.append("lost attempts count")
    elif run.max_lost_attempts != Run.max_lost_attempts:
        parts.append(f"at most {run.max_lost_attempts} lost attempts")
    return "; ".join(parts) or None

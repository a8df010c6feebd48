"""Option types and callbacks: a bad value is a usage error (exit 2) that names the option, before
anything connects to the database."""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from typing import Any

import click

from supervisor import stopsignals
from supervisor.labels import count_problem, label_problem
from supervisor.quantities import QuantityError, parse_duration, parse_time

_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}\Z")
MIN_MEMORY = 1 << 20


def quantity(parse: Any, low: float, high: float, shown: str, unit: str) -> Any:
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


class IntRange(click.IntRange):
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


def whole_seconds(value: str) -> float:
    """A duration that is a whole number of seconds, as the run's runtime_max_sec is kept: 1.5s is
    refused rather than cut to 1 s without a word; 1.5m (90 s) is fine. Under a second is left to the
    range check, whose message says more."""
    seconds = parse_duration(value)
    if seconds >= 1 and seconds != int(seconds):
        raise QuantityError(f"{value.strip()} is not a whole number of seconds")
    return int(seconds) if seconds >= 1 else seconds


def signal_name(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A signal by name from the allowed list (stopsignals.SIGNALS), kept short: sigint -> INT."""
    if value is None:
        return None
    short = stopsignals.short_name(value.strip())
    if short not in stopsignals.SIGNALS:
        raise click.BadParameter(f"{value!r} is not one of {', '.join(stopsignals.SIGNALS)}")
    return short


def env_pairs(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in values:
        name, value = _split_pair(item, "NAME=VALUE")
        if not _ENV_NAME_RE.match(name):
            raise click.BadParameter(f"{name!r} is not a valid environment variable name")
        if "\n" in value or "\0" in value:
            raise click.BadParameter(f"the value of {name} contains a newline or NUL")
        env[name] = value
    return env


def label_pairs(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[str, str]:
    """KEY=VALUE pairs, each a label as the database accepts it (supervisor/labels.py), checked here too
    so that a typo is a usage error that names the option."""
    labels: dict[str, str] = {}
    for item in values:
        key, value = _split_pair(item, "KEY=VALUE")
        problem = label_problem(key, value)
        if problem:
            raise click.BadParameter(problem)
        labels[key] = value
    problem = count_problem(labels)
    if problem:
        raise click.BadParameter(problem)
    return labels


def time_or_duration(ctx: click.Context, param: click.Parameter, value: str | None) -> datetime | timedelta | None:
    """--not-before and --start-deadline: a time, or a duration from the database's now (resolved in
    submit, once connected)."""
    if value is None:
        return None
    try:
        return parse_time(value)
    except QuantityError as exc:
        raise click.BadParameter(str(exc)) from None


def concurrency_key(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    # As unitvisor.submit_run checks it (runs_concurrency_key_valid), here too: a typo is a usage error.
    if value is not None and (not 1 <= len(value) <= 255 or any(ord(c) < 32 or ord(c) == 127 for c in value)):
        raise click.BadParameter("a concurrency key is 1 to 255 characters without control characters")
    return value


def at_time(when: datetime | timedelta | None, now: datetime) -> datetime | None:
    return now + when if isinstance(when, timedelta) else when


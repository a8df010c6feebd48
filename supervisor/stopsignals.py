"""A run's graceful stop (schema 026): its stop signal, stop timeout and warning. Pure: no I/O, no clock.

A run names signals from a fixed list (SIGNALS, the same as SQL's unitvisor.stop_signal_names(): a
test compares them), by name, so that nothing a submitter writes reaches a unit property unchecked: the
name is looked up here and only the number of a listed signal goes to systemd (KillSignal=, KillUnit).
A name outside the list is refused (Refused), also for a row that reached the daemon another way.

The warning: nothing in systemd sends a signal before RuntimeMaxSec= ends a unit, so the run's host
sends warn_signal itself (KillUnit) at the unit's start + runtime_max_sec - warn_before, and records it
on the attempt (warned_at), once. A daemon that restarts finds the due time again from the unit's own
start time; one that was down at that moment sends the warning when it is back, late, if the run still
runs; one down until runtime_max_sec has passed sends none (systemd ends the run all the same).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from datetime import datetime, timedelta

from supervisor.model import Attempt, Run

# Short names, as runs keep them and exit statuses write them (signal:TERM). Those a program may catch
# to stop or checkpoint, and KILL (a stop that allows no cleanup). Not STOP or CONT (a stop by them is
# no stop), nor the kernel's fault signals.
SIGNALS = ("TERM", "INT", "HUP", "QUIT", "USR1", "USR2", "ALRM", "WINCH", "KILL")
DEFAULT_STOP_SIGNAL = "TERM"  # systemd's KillSignal= default, and what a run without one gets
DEFAULT_WARN_SIGNAL = "USR1"  # Slurm's --signal default; what submit_run stores when warn_before comes alone
# KillUnit's `whom`: the unit's main process only. A warning is for the program to act on (checkpoint,
# then tell its children); sent to every process of the unit it would end each child that does not
# catch it (USR1's default action is to terminate), a `sleep` in a shell script among them.
WARN_WHOM = "main"


class Refused(Exception):
    """A signal name not in SIGNALS (or KILL as a warning)."""


def short_name(name: str) -> str:
    """'sigterm' -> 'TERM', as unitvisor.signal_short_name does."""
    upper = name.upper()
    return upper[3:] if upper.startswith("SIG") else upper


def number(name: str, what: str = "stop_signal") -> int:
    """The signal number of an allowed name; Refused for any other (`what` names the argument)."""
    short = short_name(name) if isinstance(name, str) else ""
    if short not in SIGNALS or (what == "warn_signal" and short == "KILL"):
        raise Refused(f"{what} {name!r} is not one of {', '.join(SIGNALS)}")
    return int(getattr(signal, "SIG" + short))


def stop_signal(run: Run) -> str:
    """The short name of the signal that stops the run (a cancel, runtime_max_sec)."""
    return short_name(run.stop_signal) if run.stop_signal else DEFAULT_STOP_SIGNAL


@dataclass(frozen=True)
class Warning:
    """A warning due to an attempt's unit: its signal, and when (this host's clock)."""

    attempt: Attempt
    signal: str
    due: datetime
    before: int  # warn_before: seconds from `due` to the end runtime_max_sec makes

    @property
    def unit_name(self) -> str:
        return self.attempt.unit_name


def warning(run: Run, attempt: Attempt, started: datetime) -> Warning | None:
    """The warning the run asks for, due runtime_max_sec - warn_before after its unit started; None when
    it asks for none, it was sent already, or the run is being cancelled (its stop is on its way)."""
    if (run.warn_before is None or run.runtime_max_sec is None or attempt.warned_at is not None
            or run.cancel_requested_at is not None):
        return None
    name = short_name(run.warn_signal or DEFAULT_WARN_SIGNAL)
    return Warning(attempt, name, started + timedelta(seconds=run.runtime_max_sec - run.warn_before), run.warn_before)


class Schedule:
    """The warnings due to one host's running units, by unit name. The daemon owns it (it outlives a
    reconnect, and its loop's timer reads it); the reconciler adds to it when it starts or finds a unit,
    and takes what is due."""

    def __init__(self) -> None:
        self._by_unit: dict[str, Warning] = {}

    def add(self, warning: Warning | None) -> None:
        if warning is not None:
            self._by_unit[warning.unit_name] = warning

    def drop(self, unit_name: str) -> None:
        self._by_unit.pop(unit_name, None)

    def __contains__(self, unit_name: object) -> bool:
        return unit_name in self._by_unit

    def __len__(self) -> int:
        return len(self._by_unit)

    def unit_names(self) -> list[str]:
        return list(self._by_unit)

    def next_due(self) -> datetime | None:
        return min((w.due for w in self._by_unit.values()), default=None)

    def take_due(self, now: datetime) -> list[Warning]:
        """The warnings due by `now`, earliest first, taken out of the schedule."""
        due = sorted((w for w in self._by_unit.values() if w.due <= now), key=lambda w: w.due)
        for warning in due:
            del self._by_unit[warning.unit_name]
        return due

"""Admission by pressure: how much the kernel says the runs of this host's slice are stalling (PSI),
and what the daemon claims because of it.

`decide` is the policy and is pure (every branch is in tests/unit/test_pressure.py); `parse` reads
one pressure file's text; `read` is the shell around them, the one place that touches /sys and /proc,
and never raises: a file it cannot read turns admission by pressure off, saying why, because a host
that claims nothing over a figure it cannot read would stop the fleet's work for a missing feature.

The figure is `avg10` of the `some` line: the share of the last ten seconds (an exponentially
weighted average the kernel updates every 2 s) in which at least one task of the slice waited for
the resource. `some`, not `full`: a slice of many runs is rarely stalled as a whole, and it is the
first runs to stall that say the host is full. avg10, not avg60: a claim decision is made every few
seconds, and avg60 would keep a host closed for a minute after a spike had ended.
"""

from __future__ import annotations

import errno
import math
from dataclasses import dataclass
from pathlib import Path

from supervisor import cgroup

RESOURCES = ("memory", "io", "cpu")
# The states of admission, as STATUS=, `unitvisor hosts`, the metrics and the hosts table name them.
OFF, OPEN, SLOWED, STOPPED = "off", "open", "slowed", "stopped"
STATES = (OFF, OPEN, SLOWED, STOPPED)

PROC_PRESSURE = Path("/proc/pressure")


class PressureError(ValueError):
    """A pressure file's text is not what the kernel writes."""


@dataclass(frozen=True)
class Reading:
    """avg10 of `some`, in percent, for each resource read; or why none could be read."""

    figures: dict[str, float]
    unavailable: str | None = None


@dataclass(frozen=True)
class Admission:
    state: str
    # Runs one claim may take: None without a bound (open, off), 0 for none (stopped).
    limit: int | None
    resource: str | None = None  # the resource whose figure decided (the highest watched one)
    figure: float | None = None
    detail: str = ""  # one line for STATUS= and the daemon's event


def parse(text: str) -> float:
    """avg10 of the `some` line of a pressure file (`some avg10=1.23 avg60=... total=...`)."""
    for line in text.splitlines():
        words = line.split()
        if not words or words[0] != "some":
            continue
        fields = dict(word.partition("=")[::2] for word in words[1:])
        try:
            value = float(fields["avg10"])
        except (KeyError, ValueError):
            raise PressureError(f"no number in avg10 of {line.strip()!r}") from None
        if not (math.isfinite(value) and 0.0 <= value <= 100.0):
            raise PressureError(f"avg10 {value} is not a percentage")
        return value
    raise PressureError("no `some` line")


def read(slice_name: str, resources: tuple[str, ...], cgroup_root: Path = cgroup.ROOT,
         proc_pressure: Path = PROC_PRESSURE) -> Reading:
    """The slice's figures for `resources`, or why they cannot be had. Never raises."""
    if not resources:
        return Reading({}, "[host] pressure_resources is empty")
    if cgroup.controllers(cgroup_root) is None:
        return Reading({}, f"{cgroup_root} is not cgroup v2 (PSI per slice needs it)")
    try:
        (proc_pressure / resources[0]).read_text()
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOENT):
            # Debian's kernels are built with PSI on (CONFIG_PSI=y); one built with
            # CONFIG_PSI_DEFAULT_DISABLED answers EOPNOTSUPP until booted with psi=1.
            return Reading({}, "the kernel's PSI is disabled (boot it with psi=1)")
        return Reading({}, f"{proc_pressure / resources[0]}: {exc.strerror or exc}")
    directory = cgroup_root / slice_name
    if not directory.is_dir():
        # systemd makes the slice's cgroup with its first unit and removes it after the last one:
        # nothing runs in it, so nothing of it stalls.
        return Reading({name: 0.0 for name in resources})
    figures: dict[str, float] = {}
    for name in resources:
        path = directory / f"{name}.pressure"
        try:
            figures[name] = parse(path.read_text())
        except FileNotFoundError:
            if not directory.is_dir():  # removed between the two looks: empty, as above
                return Reading({n: 0.0 for n in resources})
            return Reading({}, f"{path} does not exist")
        except OSError as exc:
            return Reading({}, f"{path}: {exc.strerror or exc}")
        except PressureError as exc:
            return Reading({}, f"{path}: {exc}")
    return Reading(figures)


def decide(reading: Reading, slow_at: float, stop_at: float, batch: int) -> Admission:
    """What this host claims under `reading`: everything up to `batch` a claim (open), fewer (slowed:
    from `batch` at `slow_at` down to 1 just under `stop_at`, linearly), or nothing (stopped, from
    `stop_at` on). Off where nothing could be read. The highest watched figure decides."""
    if reading.unavailable is not None:
        return Admission(OFF, None, detail=f"admission by pressure off: {reading.unavailable}")
    if not reading.figures:
        return Admission(OFF, None, detail="admission by pressure off: no resource watched")
    resource = max(sorted(reading.figures), key=lambda name: reading.figures[name])
    figure = reading.figures[resource]
    said = f"{resource} pressure {figure:.1f}% (avg10)"
    if figure >= stop_at:
        return Admission(STOPPED, 0, resource, figure, f"{said} >= {stop_at:g}%: claiming nothing")
    if figure >= slow_at:
        span = stop_at - slow_at
        limit = max(1, min(batch, math.floor(batch * (stop_at - figure) / span))) if span > 0 else 1
        return Admission(SLOWED, limit, resource, figure, f"{said} >= {slow_at:g}%: claiming at most {limit} "
                         "run(s) a poll interval")
    # No resource named while open: which near-zero figure is highest changes all the time, and what
    # decides is reported (and logged) only when it changes.
    return Admission(OPEN, None, None, figure, f"{said}, under {slow_at:g}%")

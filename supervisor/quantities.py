"""Human quantities (sizes, durations, percentages) to plain numbers, with one clear error each.

Used by the CLI and by the configuration file, so that `--memory 2G` and `memory_budget = "2G"`
mean the same thing. Pure functions.
"""

from __future__ import annotations

import math
import re

# Binary multiples, as systemd's MemoryMax= reads them: "256M" is 256 MiB, not 256 MB. Chosen so that
# the same string means the same bytes here and in a unit file an admin writes by hand.
_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(?:i?B)?\s*$", re.IGNORECASE)
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|)\s*$")
_PERCENT_RE = re.compile(r"^\s*(\d+)\s*%?\s*$")


class QuantityError(ValueError):
    """A quantity that cannot be read; the message names the value and what is accepted."""


def parse_size(text: str | int) -> int:
    """'512M' -> 536870912. Accepts a whole number of bytes or K, M, G, T (binary multiples)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = _SIZE_RE.match(str(text))
        if not match:
            raise QuantityError(f"invalid size {text!r}: use a whole number with K, M, G or T, like 512M or 2G")
        value = int(match.group(1)) * _SIZE_UNITS[match.group(2).upper()]
    if value <= 0:
        raise QuantityError(f"invalid size {text!r}: must be more than zero")
    return value


def parse_duration(text: str | int | float) -> float:
    """'90s', '10m', '2h', '1d' or a bare number of seconds -> seconds."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = _DURATION_RE.match(str(text))
        if not match:
            raise QuantityError(f"invalid duration {text!r}: use a number with s, m, h or d, like 90s or 10m")
        value = float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    if not math.isfinite(value):
        raise QuantityError(f"invalid duration {text!r}: must be a finite number")
    if value <= 0:
        raise QuantityError(f"invalid duration {text!r}: must be more than zero")
    return value


def parse_percent(text: str | int) -> int:
    """'50%' -> 50; '200%' is two CPUs' worth."""
    match = _PERCENT_RE.match(str(text))
    if not match or isinstance(text, bool):
        raise QuantityError(f"invalid percentage {text!r}: use a whole number like 50% or 200%")
    value = int(match.group(1))
    if value <= 0:
        raise QuantityError(f"invalid percentage {text!r}: must be more than 0%")
    return value


def format_size(value: int | None) -> str:
    if value is None:
        return "-"
    if value == 0:
        return "0"
    for unit in ("T", "G", "M", "K"):
        if value % _SIZE_UNITS[unit] == 0:
            return f"{value // _SIZE_UNITS[unit]}{unit}"
    return str(value)


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    if seconds < 9.95:
        return f"{seconds:.0f}s" if seconds == int(seconds) else f"{seconds:.1f}s"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    if seconds < 86400:
        return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"
    return f"{int(seconds // 86400)}d{int(seconds % 86400 // 3600):02d}h"


def format_bytes(value: int) -> str:
    """A measured size for people, as systemctl shows one: 512B, 1.5K, 34.0M, 2.1G (1024-based).
    Not format_size, which is exact for a limit someone wrote; a measurement is rarely a round size."""
    if value < 1024:
        return f"{value}B"
    size = float(value)
    for unit in ("K", "M", "G", "T", "P"):
        size /= 1024
        if size < 1024 or unit == "P":
            break
    return f"{size:.1f}{unit}"


def format_cpu_time(nsec: int) -> str:
    """A measured CPU time for people: 850us, 12ms, 1.2s, then as format_duration (3m05s, 1h02m)."""
    if nsec < 1_000_000:
        return f"{nsec // 1000}us"
    if nsec < 1_000_000_000:
        return f"{nsec // 1_000_000}ms"
    seconds = nsec / 1e9
    return f"{seconds:.1f}s" if seconds < 59.95 else format_duration(seconds)

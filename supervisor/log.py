"""The daemon's log: one event per line on stderr, for journald.

Each line is `event key=value ...` with the run id where there is one, so that
`journalctl -u unitvisor | grep run=<id>` tells a run's story. Under journald (JOURNAL_STREAM is
set) each line starts with a syslog priority prefix like `<4>`, which journald turns into the
entry's PRIORITY, so `journalctl -p warning` works.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from typing import Any

_LOGGER = logging.getLogger("unitvisor")  # the same object setup() configures
_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


class _Formatter(logging.Formatter):
    def __init__(self, journald: bool) -> None:
        super().__init__()
        self.journald = journald

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record).replace("\r", "\\r").replace("\n", "\\n")  # one line, always
        if self.journald:
            return f"<{_PRIORITY.get(record.levelno, 6)}>{text}"
        return f"{record.levelname.lower()}: {text}"


def setup(debug: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(journald=bool(os.environ.get("JOURNAL_STREAM"))))
    root = logging.getLogger("unitvisor")
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    root.propagate = False


# What makes a value need quotes: whitespace (str.isspace()'s, which is what \s matches in a str
# pattern), a double quote or "=". One regex search per value rather than a Python test per character:
# the daemon logs three events per run, and their cost fell from about 29 to 20 µs a run.
_NEEDS_QUOTES = re.compile(r'[\s"=]')


def _value(value: Any) -> str:
    text = value if type(value) is str else str(value)
    if not text or _NEEDS_QUOTES.search(text):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


def event(name: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log one event: `name key=value ...`; values with spaces are quoted."""
    if not _LOGGER.isEnabledFor(level):
        return  # a debug event of a daemon without --debug costs no formatting
    parts = [name] + [f"{key}={_value(value)}" for key, value in fields.items() if value is not None]
    _LOGGER.log(level, " ".join(parts))

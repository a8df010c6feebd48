"""A run's environment, delivered through a root-only file instead of the unit's `Environment=`.

`Environment=` is a property of the unit that any local user reads over D-Bus (`systemctl show -p
Environment`), and PID 1 also writes it into /run/systemd/transient/<unit>, which is world-readable.
`EnvironmentFiles=` carries only a path: PID 1 (root) reads the file when it spawns the command, and
the file lives in a directory only root may enter, so the values reach root and the run, no one else.

One file per attempt, named after its unit (`<unit name>.env`): the reconciler writes it before the
start, removes it once the attempt's outcome is recorded (or its start failed), and removes any file
whose attempt is not open on this host (a daemon killed between writing and starting). The unit name
is the attempt's idempotency key, so a second write for the same attempt (an adoption, a retried
start) writes the same content to the same place.

The directory is on /run (tmpfs): nothing of it outlives a reboot, and fsync would buy nothing.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

# Under the daemon's RuntimeDirectory= (units/unitvisor.service), which systemd makes 0700 root and
# keeps across daemon restarts (RuntimeDirectoryPreserve=yes): runs in flight keep their files.
RUNTIME_DIRECTORY = Path("/run/unitvisor")
DIRECTORY = RUNTIME_DIRECTORY / "environment"
SUFFIX = ".env"
# A file being written: `.<unit name>.env.<random>.tmp`, renamed to its final name once complete, so
# that PID 1 never reads half a file. The unit name stays readable in it, for the sweep.
_TEMP_RE = re.compile(r"^\.(.+)\.env\.[0-9a-f]{16}\.tmp\Z")
_FINAL_RE = re.compile(r"^([^.].*)\.env\Z")

# The characters that a backslash escapes inside double quotes in systemd's env-file parser
# (env-file.c, SHELL_NEED_ESCAPE); inside double quotes every other character, `#`, `'`, `;`, `=`,
# spaces and tabs included, is taken as it is, and a backslash before any other character stays.
_NEEDS_ESCAPE = frozenset('"\\`$')


class EnvironmentFileError(Exception):
    """The environment directory is not what it must be (not ours, not root-only)."""


def quote(value: str) -> str:
    """`value` as a double-quoted env-file value that systemd reads back exactly. The schema refuses
    newline and NUL in values (a newline would end the quoted value's line in no way we can escape:
    systemd eats backslash-newline as a continuation)."""
    if "\n" in value or "\0" in value:
        raise ValueError("an environment value may not contain a newline or NUL")
    return '"' + "".join("\\" + c if c in _NEEDS_ESCAPE else c for c in value) + '"'


def encode(environment: Mapping[str, str]) -> bytes:
    """The file's content: one `NAME="value"` line per variable, sorted (the same input, the same
    bytes). Names are already valid environment names (unitspec checks them)."""
    return "".join(f"{name}={quote(value)}\n" for name, value in sorted(environment.items())).encode()


def unit_of(filename: str) -> str | None:
    """The unit name a file in the directory belongs to (final or temporary), None for any other."""
    match = _FINAL_RE.match(filename) or _TEMP_RE.match(filename)
    return match.group(1) if match else None


class EnvironmentFiles:
    """The files of one directory (DIRECTORY, or a test's own)."""

    def __init__(self, directory: Path | None = None) -> None:
        # Read at construction, not at import: the unit tests point DIRECTORY at a temporary one.
        self.directory = directory or DIRECTORY

    def path(self, unit_name: str) -> Path:
        if "/" in unit_name or unit_name.startswith(".") or not unit_name:
            raise ValueError(f"not a unit name: {unit_name!r}")
        return self.directory / (unit_name + SUFFIX)

    def _ensure_directory(self) -> None:
        """Create the directory (and its parent, when run outside the daemon's unit) root-only, and
        refuse one that someone else owns or others may enter: the values would leak through it."""
        for directory in (self.directory.parent, self.directory):
            with contextlib.suppress(FileExistsError):
                os.mkdir(directory, 0o700)
        info = os.lstat(self.directory)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            raise EnvironmentFileError(f"{self.directory} is not a directory of uid {os.geteuid()}")
        if stat.S_IMODE(info.st_mode) & 0o077:
            os.chmod(self.directory, 0o700)

    def write(self, unit_name: str, environment: Mapping[str, str]) -> Path:
        """Write the attempt's file atomically (complete under its name, or not there); its path."""
        final = self.path(unit_name)
        self._ensure_directory()
        temp = self.directory / f".{unit_name}{SUFFIX}.{secrets.token_hex(8)}.tmp"
        # O_EXCL|O_NOFOLLOW: a new file of ours, never one (or a link) that was there before; 0600 from
        # the start, so there is no moment at which another user could open it.
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(encode(environment))
            os.rename(temp, final)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
            raise
        return final

    def remove(self, unit_name: str) -> bool:
        """Remove the attempt's file; False when there was none (no environment, or already removed)."""
        try:
            os.unlink(self.path(unit_name))
        except FileNotFoundError:
            return False
        return True

    def listing(self) -> dict[str, str | None]:
        """Every file in the directory: its name -> the unit it belongs to (None: not one of ours)."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return {}
        return {name: unit_of(name) for name in names}

    def remove_file(self, filename: str) -> bool:
        if "/" in filename or filename in ("", ".", ".."):
            raise ValueError(f"not a file name: {filename!r}")
        try:
            os.unlink(self.directory / filename)
        except FileNotFoundError:
            return False
        except IsADirectoryError:
            return False
        return True

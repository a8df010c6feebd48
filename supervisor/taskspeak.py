"""An attempt's peak number of tasks: the kernel's `pids.peak` of its unit's cgroup, kept past the unit.

systemd keeps no task figure of an ended unit (TasksCurrent is a live count), and it removes the unit's
cgroup, `pids.peak` with it, as the unit ends, before the daemon can read anything: even a unit kept
loaded (AddRef, RemainAfterExit) has no cgroup left (seen on systemd 257). So the unit reads it itself,
at its very end: an `ExecStopPost=` runs in the unit's own cgroup after every process of the run is
gone (KillMode=control-group) and before systemd removes the cgroup, whatever ended the run (an exit,
a signal, an OOM kill, a timeout, a stop). It copies the figure to `<DIRECTORY>/<unit name>`; the
daemon (or the reconciler after a restart) reads it with the outcome, keeps it in the attempt's
`tasks_peak` (sql/migrations/017_accounting.sql), and removes the file once the outcome is recorded; the
reconciler's sweep removes what no open attempt of this host owns.

The command is the same for every unit (STOP_POST_COMMAND): no run's data is in it, nothing of it is
expanded by systemd (no-env-expand), and it reads only what the kernel says (its own /proc/self/cgroup
and the cgroup's pids.peak). `+` (privileged): it runs as root outside the run's sandbox, so that it
can write to /run/unitvisor (0700 root), where a run never reaches (unitspec.ROOT_RUN_INACCESSIBLE).
`-` (ignore-failure), and it exits 0 anyway: a figure that cannot be copied never changes how the run
ended. It prints nothing (its output would be the run's, in the journal and the output tail).

It costs PID 1 one fork and exec of /bin/sh per unit, which is measurable at the rate the daemon starts
units (docs/benchmarks.md, "The tasks-peak stop command"), so a unit gets it only where it can copy
something: `available()`, read once by the reconciler, says whether this host has `pids.peak` (the
unified hierarchy with the pids controller, Linux 6.1 or later: Debian 12 and 13 on cgroup v2, their
default). Elsewhere (cgroup v1 or hybrid, v2 without the pids controller, kernels before 6.1 such as
Debian 11's 5.10) no unit has the command, and the attempt records NULL: not measured. The command itself writes
nothing where it finds no `pids.peak` all the same.

A unit started with RemainAfterExit=yes (past MAX_HELD_UNITS, or by `unitvisor reconcile` by hand)
runs it only when released, after its outcome is recorded (NULL) and in a cgroup made anew for it: the
figure it writes then is not the run's, and is never read; the sweep removes it.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from supervisor import cgroup
from supervisor.runenv import RUNTIME_DIRECTORY

DIRECTORY = RUNTIME_DIRECTORY / "tasks-peak"

PROC_CGROUP = Path("/proc/self/cgroup")


def stop_post_script(directory: Path = DIRECTORY, cgroup_root: Path = cgroup.ROOT,
                     proc_cgroup: Path = PROC_CGROUP) -> str:
    """The shell script of STOP_POST_COMMAND (the paths are parameters for the tests alone). dash's
    builtins only (read, case, test, echo): one fork and exec of /bin/sh per unit, nothing more. The
    unified hierarchy's line of /proc/self/cgroup is "0::<path>", whose basename is the unit's name."""
    return (
        "exec 2>/dev/null; "
        f"while IFS= read -r line; do case $line in 0::/?*) cg=${{line#0::}};; esac; done <{proc_cgroup}; "
        f'[ -n "$cg" ] && [ -f "{cgroup_root}$cg/pids.peak" ] && [ -d {directory} ] '
        f'&& read -r peak <"{cgroup_root}$cg/pids.peak" '
        f'&& echo "$peak" >"{directory}/${{cg##*/}}"; '
        "exit 0"
    )


# ExecStopPostEx=: (path, argv, flags). The flags are systemd's names of the prefixes `+`, `-`, `:`.
STOP_POST_COMMAND = (b"/bin/sh", [b"/bin/sh", b"-c", stop_post_script().encode()],
                     [b"privileged", b"ignore-failure", b"no-env-expand"])

def _kernel(release: str) -> tuple[int, int]:
    try:
        major, minor = release.split("-")[0].split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return (0, 0)


# pids.peak came with Linux 6.1 (commit 5251c6c436ed, "cgroup: add pids.peak interface for pids
# controller", merged for 6.1): Debian 12's 6.1 has it (seen on 6.1.0-57, 6.1.192-3, booted under
# cgroup v2 in qemu: a cgroup that had forked 20 children read 21), Debian 13's 6.12 too (the VM tier);
# Debian 11's 5.10 has none. 6.1's cgroup-v1 pids hierarchy has the file as well, but a v1 or hybrid
# host's units are not in a v2 cgroup with the pids controller, which is where the command looks.
PIDS_PEAK_SINCE = (6, 1)


def unavailable(cgroup_root: Path = cgroup.ROOT, release: str | None = None) -> str | None:
    """Why this host's kernel keeps no pids.peak for a unit's cgroup, or None where it keeps one: the
    unified hierarchy at /sys/fs/cgroup offering the pids controller, on Linux 6.1 or later. A hybrid
    host's unified tree has no controllers, and is not at /sys/fs/cgroup."""
    controllers = cgroup.controllers(cgroup_root)
    if controllers is None:
        return f"{cgroup_root} is not cgroup v2 (a v1 or hybrid hierarchy)"
    if "pids" not in controllers:
        return f"cgroup v2 at {cgroup_root} without the pids controller"
    release = release or os.uname().release
    if _kernel(release) < PIDS_PEAK_SINCE:
        return f"Linux {release} is older than 6.1, which brought pids.peak"
    return None


def available(cgroup_root: Path = cgroup.ROOT, release: str | None = None) -> bool:
    """Whether this host's kernel keeps a pids.peak for a unit's cgroup (unavailable() says why not)."""
    return unavailable(cgroup_root, release) is None


# pids.peak is an int64 counter of tasks; anything past pid_max (4194304) is not one, but bounded only by
# what the column takes, as the other figures are.
_MAX = 2**63 - 1


def parse(text: str) -> int | None:
    """The figure a file holds, None when it is not one (empty, cut short, "max", anything else)."""
    text = text.strip()
    if not text.isascii() or not text.isdigit():
        return None
    value = int(text)
    return value if value <= _MAX else None


class TasksPeakFiles:
    """The figures of one directory (DIRECTORY, or a test's own)."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory or DIRECTORY

    def path(self, unit_name: str) -> Path:
        if "/" in unit_name or unit_name.startswith(".") or not unit_name:
            raise ValueError(f"not a unit name: {unit_name!r}")
        return self.directory / unit_name

    def ensure_directory(self) -> None:
        """Create the directory root-only (its parent too, outside the daemon's unit): the stop command
        writes nothing where there is none. Called before a unit starts; two system calls."""
        for directory in (self.directory.parent, self.directory):
            with contextlib.suppress(FileExistsError):
                os.mkdir(directory, 0o700)

    def read(self, unit_name: str) -> int | None:
        """The unit's peak, None when it left none (not ended yet, no pids.peak here). Only a regular
        file is read (the directory is root's alone: nobody else can put one there)."""
        try:
            fd = os.open(self.path(unit_name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                return None
            return parse(os.read(fd, 64).decode("ascii", "replace"))
        finally:
            os.close(fd)

    def remove(self, unit_name: str) -> bool:
        try:
            os.unlink(self.path(unit_name))
        except (FileNotFoundError, IsADirectoryError):
            return False
        return True

    def listing(self) -> list[str]:
        """Every file in the directory (each named after its unit)."""
        try:
            return sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return []

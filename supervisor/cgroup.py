"""This host's cgroup tree as the daemon and `doctor` see it: where it is mounted, and whether it is
the unified (v2) hierarchy and with which controllers.

One home for what admission by pressure (pressure.py: PSI per slice), a run's peak tasks (taskspeak.py:
pids.peak) and doctor's `cgroups` line each need to know, so that the three cannot disagree about what
a cgroup-v2 host is: if one said v2 and another v1, `doctor` would promise a figure the daemon never
records, or the reverse.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


def controllers(root: Path = ROOT) -> frozenset[str] | None:
    """The controllers the unified hierarchy mounted at `root` offers (its cgroup.controllers, which
    exists only at a cgroup-v2 root), empty when it offers none; None where `root` is not a cgroup-v2
    root: cgroup v1, or the hybrid layout, whose /sys/fs/cgroup is a tmpfs of v1 trees beside a
    `unified` tree without controllers. A file that cannot be read counts as none: nothing that needs
    cgroup v2 could read its other files either."""
    try:
        return frozenset((root / "cgroup.controllers").read_text().split())
    except OSError:
        return None

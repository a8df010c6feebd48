"""Named crash points for the failure drills: inert unless UNITVISOR_FAULT names one.

A test sets UNITVISOR_FAULT=<point> in the daemon's environment; when the daemon reaches that point
it kills itself with SIGKILL, exactly as an OOM kill or a power cut would, with no cleanup at all.
"""

from __future__ import annotations

import os
import signal

POINTS = ("after-claim", "after-environment-file", "after-start", "before-outcome", "mid-reconcile")


def point(name: str) -> None:
    assert name in POINTS, name
    if os.environ.get("UNITVISOR_FAULT") == name:
        os.kill(os.getpid(), signal.SIGKILL)

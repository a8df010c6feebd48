"""Named crash points for the failure drills: inert unless UNITVISOR_FAULT names one.

A test sets UNITVISOR_FAULT=<point> in the daemon's environment; when the daemon reaches that point
it kills itself with SIGKILL, exactly as an OOM kill or a power cut would, with no cleanup at all.
UNITVISOR_FAULT_PAUSE=<point>:<seconds> instead holds the daemon there that long, once per process: a
daemon descheduled, or an answer late, at that step (tests/system/test_fence.py: a claim whose units
start after the lease is over).
"""

from __future__ import annotations

import os
import signal
import time

POINTS = ("after-claim", "after-environment-file", "after-start", "before-outcome", "mid-reconcile",
          "after-river-claim")


def point(name: str) -> None:
    assert name in POINTS, name
    if os.environ.get("UNITVISOR_FAULT") == name:
        os.kill(os.getpid(), signal.SIGKILL)
    where, _, seconds = os.environ.get("UNITVISOR_FAULT_PAUSE", "").partition(":")
    if where == name and name not in _paused:
        _paused.add(name)
        time.sleep(float(seconds))


_paused: set[str] = set()

"""The one place that repairs state: it compares this host's open attempts with systemd's units and
acts on each pair. `decide` is pure and holds the whole policy; `Reconciler` carries decisions out.

Decision table (every row has a unit test in tests/unit/test_reconciler.py):

| attempt row                        | systemd has                 | action                                   |
|------------------------------------|-----------------------------|------------------------------------------|
| not started, run not cancelled     | no unit                     | START it under the same name             |
| not started, cancel requested      | no unit                     | SETTLE as cancelled, start nothing       |
| any                                | unit, process still running | ADOPT (record start and invocation id)   |
| any, cancel requested              | unit, process still running | STOP it; it settles as cancelled         |
| any                                | unit, ended                 | SETTLE with the unit's outcome, release  |
| started                            | no unit (reboot, reset)     | GONE: cancelled if requested, else lost  |
| outcome already recorded           | unit with our prefix        | RELEASE the unit (crash before release)  |
| no row on this host                | unit with our prefix        | STOP_ORPHAN (or leave it, by config)     |

Time alone never proves a run dead: an attempt is only settled from what systemd (or its absence)
says about its unit.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from supervisor.model import Attempt, Run
from supervisor.outcomes import Outcome, classify
from supervisor.systemd import UnitState


class Action(enum.Enum):
    NOTHING = "nothing"
    START = "start"
    ADOPT = "adopt"
    STOP = "stop"
    SETTLE = "settle"
    GONE = "gone"
    RELEASE = "release"
    STOP_ORPHAN = "stop-orphan"
    LEAVE_ORPHAN = "leave-orphan"


@dataclass(frozen=True)
class Decision:
    action: Action
    unit_name: str
    reason: str
    outcome: Outcome | None = None
    invocation_id: str | None = None


def decide(run: Run, attempt: Attempt, unit: UnitState | None) -> Decision:
    """What to do about one open attempt, given its unit's state (None: not loaded)."""
    name = attempt.unit_name
    cancelled = run.cancel_requested_at is not None
    if unit is None:
        if attempt.started_at is None:
            if cancelled:
                return Decision(Action.SETTLE, name, "cancelled before its unit started",
                                Outcome("cancelled", None, "cancelled before its unit started"))
            return Decision(Action.START, name, "claimed but no unit yet")
        if cancelled:
            return Decision(Action.GONE, name, "unit gone after a cancel request",
                            Outcome("cancelled", None, "cancelled; the unit is gone"))
        return Decision(Action.GONE, name, "unit is gone and left no outcome in systemd",
                        Outcome("lost", None, "the unit disappeared (host reboot or reset) before its outcome "
                                "was read"))
    if unit.has_ended:
        outcome = classify(unit.result, unit.exec_main_code, unit.exec_main_status, cancel_requested=cancelled)
        return Decision(Action.SETTLE, name, f"unit ended: {outcome.reason}", outcome, unit.invocation_id or None)
    if cancelled:
        return Decision(Action.STOP, name, "cancel requested", invocation_id=unit.invocation_id or None)
    if attempt.started_at is None or (unit.invocation_id and not attempt.invocation_id):
        return Decision(Action.ADOPT, name, "unit is running", invocation_id=unit.invocation_id or None)
    return Decision(Action.NOTHING, name, "unit is running")


def decide_orphan(unit_name: str, settled: bool, stop_orphans: bool) -> Decision:
    """A unit with our prefix and no open attempt on this host."""
    if settled:
        return Decision(Action.RELEASE, unit_name, "outcome already recorded; releasing the unit")
    if stop_orphans:
        return Decision(Action.STOP_ORPHAN, unit_name, "no open attempt on this host owns this unit")
    return Decision(Action.LEAVE_ORPHAN, unit_name,
                    "no open attempt on this host owns this unit; left running by config")

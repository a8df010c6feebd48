"""Freeze and thaw: the owning daemon's side of unitvisor.freeze_run and thaw_run (schema 030).

An operator asks on any host (the CLI writes the request on the run's open attempt, in the database);
the daemon that owns the attempt is woken on unitvisor_cancel (or finds the request through its
heartbeat's `cancels` at the next poll), asks systemd to freeze or thaw the unit, and records what
happened, a refusal included: a host that cannot freeze says so (cgroup v1: PID 1 answers "not
supported") rather than pretending. A frozen unit keeps its slot (its attempt stays open) and its memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from supervisor import store
from supervisor.log import event
from supervisor.systemd import Systemd, SystemdError, SystemdUnavailable

# What each request asks of systemd, and the unit's state when it is done.
_ACTIONS = {"frozen": ("freeze", "frozen"), "thawed": ("thaw", "thawed")}
# The unit's state when the request is refused: the other one (a refused freeze leaves it running).
_UNCHANGED = {"frozen": "thawed", "thawed": "frozen"}
RESULTS = ("frozen", "thawed", "refused")


def act_on_requests(conn: store.Connection, fence: store.Fence, systemd: Systemd,
                    on_answer: Callable[[str], None] | None = None) -> int:
    """Carry out this host's pending freeze requests; return how many were answered. `on_answer` (the
    daemon's metric) hears each answer's result (RESULTS). systemd out of reach raises (the loop reconnects
    and the requests stay pending); any other refusal of PID 1 is recorded as the request's answer."""
    answered = 0
    for request in store.freeze_requests(conn, fence):
        method, done = _ACTIONS.get(request.wanted, ("thaw", "thawed"))
        refused: str | None = None
        try:
            if not getattr(systemd, method)(request.unit_name):
                refused = f"its unit {request.unit_name} is not loaded (the run is ending)"
        except SystemdUnavailable:
            raise
        except SystemdError as exc:
            refused = f"systemd refused to {method} {request.unit_name}: {exc}"
        state = done if refused is None else _UNCHANGED[done]
        if store.record_freeze(conn, fence, request, state, refused):
            answered += 1
            result = "refused" if refused else done
            if on_answer is not None:
                on_answer(result)
            event("run-" + result if refused is None else "freeze-refused",
                  level=logging.WARNING if refused else logging.INFO, host=fence.host_id, run=request.run_id,
                  attempt=request.attempt, unit=request.unit_name, detail=refused)
    return answered

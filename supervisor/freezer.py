"""Freeze and thaw: the owning daemon's side of unitvisor.freeze_run and thaw_run (schema 030).

An operator asks on any host (the CLI writes the request on the run's open attempt, in the database);
the daemon that owns the attempt is woken on its own channel (schema 048; on unitvisor_cancel before),
or finds the request through its heartbeat's `cancels` at the next poll, asks systemd to freeze or thaw
the unit, and records what happened, a refusal included: a host that cannot freeze says so (cgroup v1:
PID 1 answers "not supported") rather than pretending. A frozen unit keeps its slot (its attempt stays
open) and its memory.

A cancel wins over a freeze. A frozen run is cancelled as any other: the daemon stops its unit, and
systemd thaws a frozen unit before it stops it ("Unit is automatically thawed just before we execute a
job against the unit, e.g. before the unit is stopped": systemctl(1), freeze; unit_stop() in
src/core/unit.c), so its stop signal is delivered and its stop timeout counts as for any run. A freeze
or thaw request still pending on a run being cancelled is answered without asking systemd
(answer_for_cancelled): freezing a unit that is being stopped would at best be refused ("pending job")
and counted as a refusal to alert on, and thawing it is what its stop does anyway.

A frozen run's runtime clock counts on (decided: README, Hold and freeze): FreezeUnit and ThawUnit
change no property of the unit, and nothing here moves its RuntimeMaxSec= deadline. systemd's own
runtime stop does not thaw the unit, though, so a frozen run is not ended at its deadline; the docs
tell operators to thaw or cancel a frozen run before then, and a cancel after it stops the unit with a
job of its own, which thaws it (reconciler.decide).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Collection

from supervisor import store
from supervisor.log import event
from supervisor.systemd import Systemd, SystemdError, SystemdUnavailable

# What each request asks of systemd, and the unit's state when it is done.
_ACTIONS = {"frozen": ("freeze", "frozen"), "thawed": ("thaw", "thawed")}
# The unit's state when the request is refused: the other one (a refused freeze leaves it running).
_UNCHANGED = {"frozen": "thawed", "thawed": "frozen"}
RESULTS = ("frozen", "thawed", "refused")


# Why a freeze of a run being cancelled is not done (answer_for_cancelled), as `show` prints it.
CANCELLED_FREEZE = "the run is being cancelled: its unit is stopped, not frozen"


def answer_for_cancelled(wanted: str) -> tuple[str, str | None]:
    """The answer to a freeze or thaw request pending on a run whose cancel is requested, given without
    asking systemd: (the unit's freezer state after it, why the request was not done or None). A freeze
    is refused: the unit is being stopped, and systemd thaws it to stop it. A thaw is done: the stop
    thaws it."""
    if wanted == "frozen":
        return "thawed", CANCELLED_FREEZE
    return "thawed", None


def act_on_requests(conn: store.Connection, fence: store.Fence, systemd: Systemd,
                    on_answer: Callable[[str], None] | None = None,
                    cancelling: Collection[uuid.UUID] = ()) -> int:
    """Carry out this host's pending freeze requests; return how many were answered. `on_answer` (the
    daemon's metric) hears each answer's result (RESULTS). systemd out of reach raises (the loop reconnects
    and the requests stay pending); any other refusal of PID 1 is recorded as the request's answer. The
    requests of the runs in `cancelling` (whose cancel the same pass acted on) are answered without
    systemd (answer_for_cancelled), and a freeze refused that way is not counted: nothing failed, the
    run is being stopped."""
    answered = 0
    for request in store.freeze_requests(conn, fence):
        method, done = _ACTIONS.get(request.wanted, ("thaw", "thawed"))
        refused: str | None = None
        counted = True
        if request.run_id in cancelling:
            state, refused = answer_for_cancelled(request.wanted)
            counted = refused is None
        else:
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
            if on_answer is not None and counted:
                on_answer(result)
            # A freeze refused because the run is being cancelled is said, not warned about.
            event("run-" + result if refused is None else "freeze-refused",
                  level=logging.WARNING if refused and counted else logging.INFO, host=fence.host_id,
                  run=request.run_id, attempt=request.attempt, unit=request.unit_name, detail=refused)
    return answered

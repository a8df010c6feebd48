"""The River source's decisions (issue 26, docs/river.md): pure functions of plain values.

A daemon with [river] configured claims jobs of a platform's River queue (riverqueue/river, its
`river_job` table) and makes each one a unitvisor run in the claim's transaction (store.claim_river_jobs).
From then on the River job is only the spawn request, as it was for the platform's own Go worker: it is
finished `completed` once the run's unit has started, `discarded` when the run ended without ever
starting (or could not be made at all), `cancelled` when River asked to cancel it while unitvisor held it.
What to do with a held job is decided here (decide_finish), from the job and its linked run; the
reconciler acts on it (Reconciler.finish_river_jobs), after every claim and at every pass, so that a
daemon killed between the claim and the finish finishes the job when it comes back.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from supervisor.model import TERMINAL_STATES

# River's main migration line versions whose river_job this module's statements were checked against
# (tests/integration/river_schema.py builds each): 6 came with River v0.12.0 (bulk unique jobs), 7 with
# v0.40.0 (the notification outbox; the newest at v0.43.0). A later version may change river_job, its
# states or the claim's meaning: it is refused at start (version_problem), never guessed at.
SUPPORTED_VERSIONS: dict[int, str] = {
    6: "River v0.12.0 to v0.39.x",
    7: "River v0.40.0 and later (v0.43.0 checked)",
}

# The states of a unitvisor run that are over (a run in one of them will not start any more): the
# model's, so that a state added there (skipped, schema 035) finishes River's job too.
ENDED = TERMINAL_STATES

# River's attempted_by keeps the newest 100 client ids (its producer's max_attempted_by).
ATTEMPTED_BY_MAX = 100


# attempted_by's entry of a unitvisor host: this prefix and its host id.
CLIENT_PREFIX = "unitvisor:"


def client_id(host_id: str) -> str:
    """What this host writes into a claimed job's attempted_by: stable across restarts (River's own
    client id changes on every start), so that a daemon that comes back finds the jobs it holds by the
    last entry of attempted_by, and a live host finds those of a host declared dead."""
    return f"{CLIENT_PREFIX}{host_id}"


def insert_channel(schema: str) -> str:
    """River's insert notification channel for a schema (`<schema>.river_insert`)."""
    return f"{schema}.river_insert"


def control_channel(schema: str) -> str:
    """River's control channel (`<schema>.river_control`): cancel, pause, resume."""
    return f"{schema}.river_control"


def version_problem(schema: str, versions: list[int] | None) -> str | None:
    """Why this River schema cannot be served (None: it can). `versions`: the main line's versions in
    <schema>.river_migration; None when that table does not exist."""
    known = ", ".join(str(v) for v in sorted(SUPPORTED_VERSIONS))
    if versions is None:
        return (f"[river] schema {schema}: no table {schema}.river_migration; run River's migrations "
                f"(river migrate-up) first, or name the schema River's tables are in")
    if not versions:
        return f"[river] schema {schema}: {schema}.river_migration has no version of the main line"
    newest = max(versions)
    if newest not in SUPPORTED_VERSIONS:
        return (f"[river] schema {schema}: River schema version {newest} is not one this unitvisor knows "
                f"(it knows {known}); it is not served, rather than guessed at: upgrade unitvisor, or "
                f"keep River at a version whose migrations stop at {max(SUPPORTED_VERSIONS)}")
    return None


def attempt_error(at: datetime, attempt: int, message: str) -> dict[str, Any]:
    """One element of river_job.errors as River writes it (rivertype.AttemptError): when, which attempt,
    the error's text, and a trace (a Go panic's stack; empty here)."""
    stamp = at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return {"at": stamp, "attempt": attempt, "error": message, "trace": ""}


def insert_queue(payload: str) -> str | None:
    """The queue of an insert notification (`{"queue": "..."}`); None when the payload is not one."""
    try:
        data = json.loads(payload)
    except ValueError:
        return None
    queue = data.get("queue") if isinstance(data, dict) else None
    return queue if isinstance(queue, str) else None


def control_cancel(payload: str) -> int | None:
    """The job id of a control notification that asks to cancel a job; None for anything else."""
    try:
        data = json.loads(payload)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("action") != "cancel":
        return None
    job_id = data.get("job_id")
    return job_id if isinstance(job_id, int) and not isinstance(job_id, bool) else None


@dataclass(frozen=True)
class HeldJob:
    """A River job this host holds: `running`, claimed last by this host's client id."""

    job_id: int
    attempt: int
    cancel_attempted: bool  # metadata.cancel_attempted_at is set: River's JobCancel asked to cancel it


@dataclass(frozen=True)
class LinkedRun:
    """The unitvisor run made from a River job (unitvisor.river_runs)."""

    run_id: str
    state: str
    started: bool  # an attempt of it started its unit
    reason: str | None  # its last event's reason


class Finish(enum.Enum):
    COMPLETED = "completed"
    DISCARDED = "discarded"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class Decision:
    """What to do with a held job: finish it in `finish` with `error` appended (None: no error), and
    first cancel its run when `cancel_run`. `finish` None: leave it held, its run has not started yet."""

    finish: Finish | None
    error: str | None = None
    cancel_run: bool = False


WAIT = Decision(None)


def decide_finish(job: HeldJob, run: LinkedRun | None) -> Decision:
    """The finish of a held River job, from its linked run. River's Go worker for such a job returned
    once it had started the run (completed), or with an error when it could not (discarded: these jobs
    are not retried by River; unitvisor's own max_attempts retries the run). A River cancel while the
    job is held cancels the run, as River's cancel of a running job cancels its worker."""
    if run is None:
        return Decision(Finish.DISCARDED, "no unitvisor run holds this River job (it was deleted or pruned)")
    if run.started:
        # The unit started: the spawn is done, whatever the run does next (River's job was the spawn).
        return Decision(Finish.COMPLETED)
    if job.cancel_attempted:
        return Decision(Finish.CANCELLED, f"cancelled through River before unitvisor run {run.run_id} started",
                        cancel_run=run.state not in ENDED)
    if run.state in ENDED:
        why = f": {run.reason}" if run.reason else ""
        return Decision(Finish.DISCARDED, f"unitvisor run {run.run_id} ended {run.state} without starting{why}")
    return WAIT


# SQLSTATE classes of an error that says the platform's configuration is wrong, not the job: 42 (a spec
# function that does not exist, or that the daemon's role may not execute; a River table it may not
# update) and 28 (authorization). Such an error rolls back the whole claim (the jobs stay available,
# the daemon says what is wrong) instead of discarding every job it claims.
MISCONFIGURATION_CLASSES = ("42", "28")


def refuses_job(sqlstate: str | None) -> bool:
    """Whether an error raised while making a claimed job's run (the spec function, submit_river_run)
    is the job's: it is then discarded with the error as its reason, as the platform's Go worker would
    have failed it. A configuration error (MISCONFIGURATION_CLASSES) is not; nor is one with no SQLSTATE
    (the connection, not the database, failed)."""
    return bool(sqlstate) and not sqlstate.startswith(MISCONFIGURATION_CLASSES)

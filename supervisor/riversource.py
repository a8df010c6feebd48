"""The River source's steps (issue 26, docs/river.md): small calls that join store's queries to the pure
decisions of supervisor/river.py. The daemon's loop claims (claim); the reconciler finishes (finish_held),
after each claim and at each pass, so that a job held across a crash is finished when the daemon is back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import psycopg

from supervisor import river, store
from supervisor.config import RiverSettings
from supervisor.log import event


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class Finished:
    job_id: int
    state: river.Finish
    error: str | None
    written: bool  # False: the job was no longer this host's to finish (River took it back meanwhile)


def check_schema(conn: store.Connection, settings: RiverSettings) -> str | None:
    """Why River's schema cannot be served (None: it can): read once a connection, before any claim. A
    role that is not a member of unitvisor_river, or a table it may not read, is a problem said as one,
    never an error that would keep the daemon from its own runs; a lost connection is the caller's."""
    # Checked first: without the grant even a readable River schema could not make a run.
    role, may = store.river_grant(conn)
    if not may:
        return (f"[river]: role {role} is not a member of {store.RIVER_ROLE}, which may create runs from River "
                f"jobs: GRANT {store.RIVER_ROLE} TO {role} (docs/river.md, Privileges)")
    try:
        versions = store.river_versions(conn, settings.schema)
    except psycopg.Error as exc:
        if isinstance(exc, store.CONNECTION_LOST):
            raise
        return (f"[river] schema {settings.schema}: cannot read {settings.schema}.river_migration: "
                f"{store.one_line(exc)} (docs/river.md, Privileges)")
    return river.version_problem(settings.schema, versions)


def claim(conn: store.Connection, fence: store.Fence, settings: RiverSettings, limit: int,
          now: Callable[[], datetime] = _now) -> list[store.RiverClaim]:
    """Claim up to `limit` River jobs and make their runs (store.claim_river_jobs); each said once."""
    if limit <= 0:
        return []
    claimed = store.claim_river_jobs(conn, fence, settings.schema, settings.queues, settings.kinds,
                                     settings.spec_function, river.client_id(fence.host_id), limit, now)
    for one in claimed:
        if one.run_id is not None:
            event("river-claimed", job=one.job_id, attempt=one.attempt, run=one.run_id)
        else:
            event("river-discarded", level=logging.WARNING, job=one.job_id, attempt=one.attempt, detail=one.refused)
    return claimed


def finish_held(conn: store.Connection, fence: store.Fence, settings: RiverSettings,
                now: Callable[[], datetime] = _now) -> list[Finished]:
    """Finish the River jobs this host holds whose runs have moved on (river.decide_finish): completed
    once the unit started, discarded when the run ended without starting, cancelled (and the run with it)
    when River asked. A job whose run has not started yet stays held."""
    held = store.held_river_jobs(conn, settings.schema, settings.queues, settings.kinds,
                                 river.client_id(fence.host_id))
    if not held:
        return []
    runs = store.river_runs(conn, fence, [job.job_id for job in held])
    done: list[Finished] = []
    for job in held:
        decision = river.decide_finish(job, runs.get(job.job_id))
        if decision.finish is None:
            continue
        if decision.cancel_run:
            store.cancel_river_run(conn, fence, job.job_id)
        error = river.attempt_error(now(), job.attempt, decision.error) if decision.error else None
        written = store.finish_river_job(conn, settings.schema, job.job_id, job.attempt, decision.finish, error)
        event("river-finished", job=job.job_id, attempt=job.attempt, state=decision.finish.value,
              detail=decision.error or "", written=written)
        done.append(Finished(job.job_id, decision.finish, decision.error, written))
    return done

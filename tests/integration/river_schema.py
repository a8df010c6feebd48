"""River's tables for the tests of the River source (issue 26): riverqueue/river's schema at the main
line's versions unitvisor supports (supervisor/river.py SUPPORTED_VERSIONS), and a job inserted as
River's `InsertTx` inserts one (the row, then the insert notification, in the caller's transaction).

Re-derived from River's migrations `riverdriver/riverpgxv5/migration/main/00N_*.up.sql` (read at
v0.43.0; River is MPL-2.0, so nothing is copied): each version's effective tables, columns, defaults,
constraints and indexes, written out as the state the migrations leave, not as their steps:
* 6 (River v0.12.0 to v0.39.x): river_job with unique_key and unique_states and the bitmask index;
  river_queue (updated_at without a default); river_leader; river_migration by (line, version); the
  unused river_client and river_client_queue tables (005) still there.
* 7 (River v0.40.0 on): as 6, with river_job.max_attempts DEFAULT 25, river_queue.updated_at DEFAULT
  now(), river_client and river_client_queue dropped, and the river_notification outbox (unused on
  PostgreSQL).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

# River's own versions, as river_migration records them for the main line, up to each supported one.
VERSIONS = (6, 7)

_COMMON = """
CREATE SCHEMA {s};
CREATE TABLE {s}.river_migration (
    line text NOT NULL,
    version bigint NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT line_length CHECK (char_length(line) > 0 AND char_length(line) < 128),
    CONSTRAINT version_gte_1 CHECK (version >= 1),
    PRIMARY KEY (line, version)
);
CREATE TYPE {s}.river_job_state AS ENUM
    ('available', 'cancelled', 'completed', 'discarded', 'pending', 'retryable', 'running', 'scheduled');
CREATE TABLE {s}.river_job (
    id bigserial PRIMARY KEY,
    state {s}.river_job_state NOT NULL DEFAULT 'available',
    attempt smallint NOT NULL DEFAULT 0,
    max_attempts smallint NOT NULL,
    attempted_at timestamptz,
    created_at timestamptz NOT NULL DEFAULT now(),
    finalized_at timestamptz,
    scheduled_at timestamptz NOT NULL DEFAULT now(),
    priority smallint NOT NULL DEFAULT 1,
    args jsonb NOT NULL,
    attempted_by text[],
    errors jsonb[],
    kind text NOT NULL,
    metadata jsonb NOT NULL DEFAULT '{{}}',
    queue text NOT NULL DEFAULT 'default',
    tags varchar(255)[] NOT NULL DEFAULT '{{}}',
    unique_key bytea,
    unique_states bit(8),
    CONSTRAINT finalized_or_finalized_at_null CHECK (
        (finalized_at IS NULL AND state NOT IN ('cancelled', 'completed', 'discarded')) OR
        (finalized_at IS NOT NULL AND state IN ('cancelled', 'completed', 'discarded'))),
    CONSTRAINT max_attempts_is_positive CHECK (max_attempts > 0),
    CONSTRAINT priority_in_range CHECK (priority >= 1 AND priority <= 4),
    CONSTRAINT queue_length CHECK (char_length(queue) > 0 AND char_length(queue) < 128),
    CONSTRAINT kind_length CHECK (char_length(kind) > 0 AND char_length(kind) < 128)
);
CREATE INDEX river_job_kind ON {s}.river_job (kind);
CREATE INDEX river_job_state_and_finalized_at_index ON {s}.river_job (state, finalized_at)
    WHERE finalized_at IS NOT NULL;
CREATE INDEX river_job_prioritized_fetching_index ON {s}.river_job (state, queue, priority, scheduled_at, id);
CREATE INDEX river_job_args_index ON {s}.river_job USING gin (args);
CREATE INDEX river_job_metadata_index ON {s}.river_job USING gin (metadata);
CREATE FUNCTION {s}.river_job_state_in_bitmask(bitmask bit(8), state {s}.river_job_state) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT get_bit(bitmask, CASE state WHEN 'available' THEN 7 WHEN 'cancelled' THEN 6 WHEN 'completed' THEN 5
        WHEN 'discarded' THEN 4 WHEN 'pending' THEN 3 WHEN 'retryable' THEN 2 WHEN 'running' THEN 1 ELSE 0 END) = 1
$$;
CREATE UNIQUE INDEX river_job_unique_idx ON {s}.river_job (unique_key)
    WHERE unique_key IS NOT NULL AND unique_states IS NOT NULL AND {s}.river_job_state_in_bitmask(unique_states, state);
CREATE UNLOGGED TABLE {s}.river_leader (
    elected_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL,
    leader_id text NOT NULL,
    name text PRIMARY KEY DEFAULT 'default',
    CONSTRAINT name_length CHECK (name = 'default'),
    CONSTRAINT leader_id_length CHECK (char_length(leader_id) > 0 AND char_length(leader_id) < 128)
);
CREATE TABLE {s}.river_queue (
    name text PRIMARY KEY,
    created_at timestamptz NOT NULL DEFAULT now(),
    metadata jsonb NOT NULL DEFAULT '{{}}',
    paused_at timestamptz,
    updated_at timestamptz NOT NULL
);
"""

_VERSION_6 = """
CREATE UNLOGGED TABLE {s}.river_client (
    id text PRIMARY KEY,
    created_at timestamptz NOT NULL DEFAULT now(),
    metadata jsonb NOT NULL DEFAULT '{{}}',
    paused_at timestamptz,
    updated_at timestamptz NOT NULL,
    CONSTRAINT name_length CHECK (char_length(id) > 0 AND char_length(id) < 128)
);
CREATE UNLOGGED TABLE {s}.river_client_queue (
    river_client_id text NOT NULL REFERENCES {s}.river_client (id) ON DELETE CASCADE,
    name text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    max_workers bigint NOT NULL DEFAULT 0,
    metadata jsonb NOT NULL DEFAULT '{{}}',
    num_jobs_completed bigint NOT NULL DEFAULT 0,
    num_jobs_running bigint NOT NULL DEFAULT 0,
    updated_at timestamptz NOT NULL,
    PRIMARY KEY (river_client_id, name)
);
"""

_VERSION_7 = """
ALTER TABLE {s}.river_job ALTER COLUMN max_attempts SET DEFAULT 25;
ALTER TABLE {s}.river_queue ALTER COLUMN updated_at SET DEFAULT CURRENT_TIMESTAMP;
CREATE TABLE {s}.river_notification (
    id bigserial PRIMARY KEY,
    created_at timestamptz NOT NULL DEFAULT now(),
    payload text NOT NULL,
    topic text NOT NULL,
    CONSTRAINT topic_length CHECK (length(topic) > 0 AND length(topic) < 128)
);
CREATE INDEX river_notification_created_at_idx ON {s}.river_notification (created_at);
CREATE INDEX river_notification_topic_id_idx ON {s}.river_notification (topic, id);
"""

# What a platform runs for unitvisor's daemons (docs/river.md, "Privileges"), here for the test's schema.
GRANTS = """
GRANT USAGE ON SCHEMA {s} TO unitvisor_river;
GRANT SELECT, UPDATE ON {s}.river_job TO unitvisor_river;
GRANT SELECT ON {s}.river_migration, {s}.river_queue TO unitvisor_river;
"""


def create(conn: psycopg.Connection, schema: str = "river", version: int = 7) -> None:
    """River's tables in `schema` at main line `version` (6 or 7), with river_migration saying so, and
    the GRANTs docs/river.md tells a platform to run."""
    assert version in VERSIONS, version
    text = _COMMON + (_VERSION_6 if version == 6 else _VERSION_7) + GRANTS
    with conn.transaction():
        for statement in text.split(";\n"):
            if statement.strip():
                conn.execute(sql.SQL(statement.replace("{s}", "{schema}")).format(schema=sql.Identifier(schema)))
        conn.execute(sql.SQL("INSERT INTO {}.river_migration (line, version) "
                             "SELECT 'main', v FROM generate_series(1, %s) v").format(sql.Identifier(schema)),
                     (version,))


def insert_tx(conn: psycopg.Connection, kind: str, args: dict[str, Any], *, schema: str = "river",
              queue: str = "default", priority: int = 1, max_attempts: int = 1,
              scheduled_at: datetime | None = None, metadata: dict[str, Any] | None = None) -> int:
    """One job inserted as River's Client.InsertTx writes it inside the caller's transaction (the caller
    commits): the row (state available, or scheduled when scheduled_at is in the future; created_at and a
    missing scheduled_at are the database's now()), then, for an available job only, pg_notify on
    `<schema>.river_insert` with River's payload `{"queue": "<queue>"}`. Returns the job's id."""
    job_id, state = conn.execute(sql.SQL(
        """INSERT INTO {schema}.river_job (args, kind, max_attempts, metadata, priority, queue, scheduled_at,
                                          state, tags)
           VALUES (%(args)s, %(kind)s, %(max_attempts)s, %(metadata)s, %(priority)s, %(queue)s,
                   coalesce(%(scheduled_at)s, now()),
                   CASE WHEN coalesce(%(scheduled_at)s, now()) > now() THEN 'scheduled' ELSE 'available' END
                       ::{schema}.river_job_state,
                   '{{}}')
           RETURNING id, state::text""").format(schema=sql.Identifier(schema)),
        {"args": Jsonb(args), "kind": kind, "max_attempts": max_attempts, "metadata": Jsonb(metadata or {}),
         "priority": priority, "queue": queue, "scheduled_at": scheduled_at}).fetchone()
    if state == "available":
        conn.execute("SELECT pg_notify(%s, %s)", (f"{schema}.river_insert", json.dumps({"queue": queue})))
    return job_id


def job(conn: psycopg.Connection, job_id: int, schema: str = "river") -> dict[str, Any]:
    """A River job's row, its state as text."""
    row = conn.execute(sql.SQL(
        "SELECT id, state::text AS state, attempt, attempted_at, attempted_by, finalized_at, errors, metadata "
        "FROM {}.river_job WHERE id = %s").format(sql.Identifier(schema)), (job_id,)).fetchone()
    names = ("id", "state", "attempt", "attempted_at", "attempted_by", "finalized_at", "errors", "metadata")
    return dict(zip(names, row, strict=True))


def cancel(conn: psycopg.Connection, job_id: int, schema: str = "river") -> None:
    """River's JobCancel of a running job: metadata.cancel_attempted_at set (state left running), and the
    control notification to the job's queue."""
    queue = conn.execute(sql.SQL(
        "UPDATE {}.river_job SET metadata = metadata || jsonb_build_object('cancel_attempted_at', now()) "
        "WHERE id = %s RETURNING queue").format(sql.Identifier(schema)), (job_id,)).fetchone()[0]
    conn.execute("SELECT pg_notify(%s, %s)", (f"{schema}.river_control",
                                             json.dumps({"action": "cancel", "job_id": job_id, "queue": queue})))

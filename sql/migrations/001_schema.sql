-- unitvisor schema, version 1.
--
-- Everything lives in the schema "unitvisor" so that it can share a database with the control plane
-- that submits runs. The migration runner (supervisor/store.py) creates the schema and its
-- bookkeeping table before applying this file, in one transaction per file.

-- The closed vocabularies, as CHECK constraints rather than enum types: adding a value later is a
-- one-line constraint swap in a migration, where an enum would need ALTER TYPE outside a transaction.

-- Environment: a JSON object of NAME -> string. Names as POSIX shells accept them; no newline in a
-- value, because systemd's Environment= and journald both treat it as a record separator. (jsonb
-- cannot hold NUL at all.)
CREATE FUNCTION unitvisor.environment_is_valid(env jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN jsonb_typeof(env) <> 'object' THEN false ELSE NOT EXISTS (
        SELECT 1 FROM jsonb_each(env) AS e(name, value)
        WHERE e.name !~ '^[A-Za-z_][A-Za-z0-9_]{0,127}$'
           OR jsonb_typeof(e.value) <> 'string'
           OR strpos(e.value #>> '{}', E'\n') > 0)
    END
$$;

CREATE TABLE unitvisor.runs (
    id                  uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    argv                text[] NOT NULL,
    environment         jsonb NOT NULL DEFAULT '{}'::jsonb,
    working_directory   text,
    run_user            text,
    memory_max          bigint,
    cpu_quota_percent   integer,
    tasks_max           integer,
    io_weight           integer,
    runtime_max_sec     bigint,
    max_attempts        integer NOT NULL DEFAULT 1,
    retry_backoff_sec   integer NOT NULL DEFAULT 10,
    retry_backoff_max_sec integer NOT NULL DEFAULT 600,
    retry_on            text[],
    host_pin            text,
    priority            integer NOT NULL DEFAULT 0,
    state               text NOT NULL DEFAULT 'queued',
    cancel_requested_at timestamptz,
    created_at          timestamptz NOT NULL DEFAULT now(),
    updated_at          timestamptz NOT NULL DEFAULT now(),
    finished_at         timestamptz,

    CONSTRAINT runs_state_valid CHECK (state IN
        ('queued', 'starting', 'running', 'succeeded', 'failed', 'cancelled')),
    -- argv[0] must be absolute: a bare name would be looked up in systemd's PATH, and the host
    -- allowlist could not say which binary it allowed.
    -- One dimension, indexed from 1: an array like '[2:3]={sh,-c}' has no argv[1] to check.
    CONSTRAINT runs_argv_valid CHECK (
        cardinality(argv) >= 1 AND array_ndims(argv) = 1 AND array_lower(argv, 1) = 1
        AND array_position(argv, NULL) IS NULL AND argv[1] LIKE '/%'),
    CONSTRAINT runs_environment_valid CHECK (unitvisor.environment_is_valid(environment)),
    CONSTRAINT runs_working_directory_valid CHECK (
        working_directory IS NULL OR (working_directory LIKE '/%' AND strpos(working_directory, E'\n') = 0)),
    CONSTRAINT runs_run_user_valid CHECK (run_user IS NULL OR run_user ~ '^[a-z_][a-z0-9_-]{0,31}$'),
    -- Bounds: below 1 MiB nothing starts at all, and the upper ends are what the kernel and
    -- systemd accept. A value outside them is a typo, and refusing it at insert time is kinder
    -- than a unit that fails to start.
    CONSTRAINT runs_memory_max_valid CHECK (memory_max IS NULL OR memory_max BETWEEN 1048576 AND 4611686018427387904),
    CONSTRAINT runs_cpu_quota_valid CHECK (cpu_quota_percent IS NULL OR cpu_quota_percent BETWEEN 1 AND 100000),
    CONSTRAINT runs_tasks_max_valid CHECK (tasks_max IS NULL OR tasks_max BETWEEN 1 AND 4194304),
    CONSTRAINT runs_io_weight_valid CHECK (io_weight IS NULL OR io_weight BETWEEN 1 AND 10000),
    CONSTRAINT runs_runtime_max_valid CHECK (runtime_max_sec IS NULL OR runtime_max_sec BETWEEN 1 AND 315360000),
    CONSTRAINT runs_max_attempts_valid CHECK (max_attempts BETWEEN 1 AND 1000),
    CONSTRAINT runs_backoff_valid CHECK (
        retry_backoff_sec BETWEEN 0 AND 86400 AND retry_backoff_max_sec BETWEEN retry_backoff_sec AND 604800),
    CONSTRAINT runs_retry_on_valid CHECK (retry_on IS NULL OR retry_on <@ ARRAY[
        'exit-code', 'signal', 'core-dump', 'timeout', 'oom-kill', 'watchdog', 'start-failed', 'lost']::text[])
);

CREATE INDEX runs_state_idx ON unitvisor.runs (state) WHERE state IN ('queued', 'starting', 'running');
CREATE INDEX runs_created_idx ON unitvisor.runs (created_at);

-- One row per try of a run on a host. The unit name is derived from (run_id, attempt) by the
-- daemon and stored here so that operators and the reconciler can find the unit without code.
CREATE TABLE unitvisor.attempts (
    run_id        uuid NOT NULL REFERENCES unitvisor.runs (id) ON DELETE CASCADE,
    attempt       integer NOT NULL CHECK (attempt >= 1),
    host_id       text NOT NULL,
    unit_name     text NOT NULL,
    invocation_id text,
    claimed_at    timestamptz NOT NULL DEFAULT now(),
    started_at    timestamptz,
    ended_at      timestamptz,
    outcome       text,
    exit_status   text,
    reason        text,
    PRIMARY KEY (run_id, attempt),
    CONSTRAINT attempts_outcome_valid CHECK (outcome IS NULL OR outcome IN (
        'success', 'exit-code', 'signal', 'core-dump', 'timeout', 'oom-kill', 'watchdog',
        'start-failed', 'lost', 'cancelled', 'refused')),
    CONSTRAINT attempts_exit_status_valid CHECK (exit_status IS NULL OR exit_status ~ '^(exit:[0-9]+|signal:[A-Z0-9+-]+)$'),
    CONSTRAINT attempts_ended_has_outcome CHECK ((outcome IS NULL) = (ended_at IS NULL))
);

-- The daemon's working set: this host's attempts that have no outcome yet.
CREATE INDEX attempts_open_idx ON unitvisor.attempts (host_id) WHERE outcome IS NULL;
CREATE UNIQUE INDEX attempts_unit_name_idx ON unitvisor.attempts (unit_name);

-- A spawn job carries the run id and nothing else about the run: the run row is the one source of
-- truth, so a job never goes stale when the run is resumed with other limits. The other columns
-- belong to the queue.
CREATE TABLE unitvisor.spawn_jobs (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id        uuid NOT NULL REFERENCES unitvisor.runs (id) ON DELETE CASCADE,
    state         text NOT NULL DEFAULT 'available',
    priority      integer NOT NULL DEFAULT 0,
    scheduled_at  timestamptz NOT NULL DEFAULT now(),
    claimed_by    text,
    claimed_at    timestamptz,
    error         text,
    created_at    timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT spawn_jobs_state_valid CHECK (state IN ('available', 'claimed', 'discarded')),
    CONSTRAINT spawn_jobs_claim_valid CHECK ((state = 'available') = (claimed_by IS NULL))
);

-- The claim query's scan: available jobs in claim order.
CREATE INDEX spawn_jobs_available_idx ON unitvisor.spawn_jobs (priority DESC, scheduled_at, id)
    WHERE state = 'available';
-- At most one waiting job per run: a second one could only ever start the run twice.
CREATE UNIQUE INDEX spawn_jobs_one_available_idx ON unitvisor.spawn_jobs (run_id) WHERE state = 'available';

CREATE TABLE unitvisor.hosts (
    id             text PRIMARY KEY,
    name           text NOT NULL,
    state          text NOT NULL DEFAULT 'active',
    max_runs       integer NOT NULL,
    memory_budget  bigint,
    version        text,
    boot_id        text,
    started_at     timestamptz NOT NULL DEFAULT now(),
    heartbeat_at   timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT hosts_state_valid CHECK (state IN ('active', 'draining', 'stopped'))
);

-- Append-only history, for operators: every state change of a run with its reason.
CREATE TABLE unitvisor.run_events (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id     uuid NOT NULL REFERENCES unitvisor.runs (id) ON DELETE CASCADE,
    at         timestamptz NOT NULL DEFAULT now(),
    attempt    integer,
    host_id    text,
    state      text NOT NULL,
    reason     text NOT NULL
);
CREATE INDEX run_events_run_idx ON unitvisor.run_events (run_id, id);

-- NOTIFY is a wake-up hint only; daemons poll as well. One notification per statement, not per
-- row: a batch of 1000 submitted jobs wakes each daemon once.
CREATE FUNCTION unitvisor.notify_spawn_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('unitvisor_spawn', '');
    RETURN NULL;
END $$;

CREATE TRIGGER spawn_jobs_notify AFTER INSERT ON unitvisor.spawn_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION unitvisor.notify_spawn_jobs();

-- submit_run: the one way to create a run, for the CLI and for any control plane in any language.
-- It inserts the run, its first spawn job and its first event, so calling it inside the caller's
-- own transaction makes "the run exists" and "the run will be started" one atomic fact.
--
--   SELECT unitvisor.submit_run(ARRAY['/usr/bin/env', 'echo', 'hi'], memory_max => 268435456);
CREATE FUNCTION unitvisor.submit_run(
    argv                  text[],
    environment           jsonb   DEFAULT '{}'::jsonb,
    working_directory     text    DEFAULT NULL,
    run_user              text    DEFAULT NULL,
    memory_max            bigint  DEFAULT NULL,
    cpu_quota_percent     integer DEFAULT NULL,
    tasks_max             integer DEFAULT NULL,
    io_weight             integer DEFAULT NULL,
    runtime_max_sec       bigint  DEFAULT NULL,
    max_attempts          integer DEFAULT 1,
    host_pin              text    DEFAULT NULL,
    priority              integer DEFAULT 0,
    retry_backoff_sec     integer DEFAULT 10,
    retry_backoff_max_sec integer DEFAULT 600,
    retry_on              text[]  DEFAULT NULL
) RETURNS uuid LANGUAGE plpgsql AS $$
DECLARE
    new_id uuid;
BEGIN
    INSERT INTO unitvisor.runs (argv, environment, working_directory, run_user, memory_max,
        cpu_quota_percent, tasks_max, io_weight, runtime_max_sec, max_attempts, host_pin, priority,
        retry_backoff_sec, retry_backoff_max_sec, retry_on)
    VALUES (submit_run.argv, coalesce(submit_run.environment, '{}'::jsonb), submit_run.working_directory,
        submit_run.run_user, submit_run.memory_max, submit_run.cpu_quota_percent, submit_run.tasks_max,
        submit_run.io_weight, submit_run.runtime_max_sec, submit_run.max_attempts, submit_run.host_pin,
        submit_run.priority, submit_run.retry_backoff_sec, submit_run.retry_backoff_max_sec,
        submit_run.retry_on)
    RETURNING id INTO new_id;
    INSERT INTO unitvisor.spawn_jobs (run_id, priority) VALUES (new_id, submit_run.priority);
    INSERT INTO unitvisor.run_events (run_id, state, reason) VALUES (new_id, 'queued', 'submitted');
    RETURN new_id;
END $$;

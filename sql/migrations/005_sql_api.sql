-- unitvisor schema, version 5: the SQL API as a control plane's front door (issue 13, first part).
--
-- Expand only: runs gains two columns (0.2.0 reads runs by explicit column lists), and submit_run two
-- arguments, last and defaulted, so that every call written for versions 1 to 4 (positional or named,
-- as 0.2.0's CLI makes them) still means what it meant. The rest is new.

-- -- labels and idempotency keys -------------------------------------------------------------------

-- Labels: a control plane's own tags on a run (tenant, job, pipeline step), to find its runs again
-- (runs_with_labels). A JSON object of string -> string; keys as Kubernetes' label names, so that
-- they survive being put in a URL or a metric label; bounded, so that a run row stays small.
CREATE FUNCTION unitvisor.labels_are_valid(labels jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE WHEN jsonb_typeof(labels) <> 'object' THEN false
        ELSE (SELECT count(*) FROM jsonb_object_keys(labels)) <= 64 AND NOT EXISTS (
            SELECT 1 FROM jsonb_each(labels) AS l(key, value)
            WHERE l.key !~ '^[A-Za-z0-9]([A-Za-z0-9._/-]{0,61}[A-Za-z0-9])?$'
               OR jsonb_typeof(l.value) <> 'string'
               OR length(l.value #>> '{}') > 255
               OR (l.value #>> '{}') ~ '[[:cntrl:]]')
    END
$$;
REVOKE EXECUTE ON FUNCTION unitvisor.labels_are_valid(jsonb) FROM PUBLIC;

-- idempotency_key: the caller's name for one submit, so that a retried submit (a timeout, a crash
-- between COMMIT and hearing of it) finds the run it made instead of making another. Unique among all
-- runs of the database, for as long as the run exists: a control plane that shares the database with
-- others prefixes its keys.
--
-- The constraints are added NOT VALID: checked on every row written from now on, while the scan of the
-- rows already there (about 10 s per million runs) is left to `unitvisor migrate`, which validates them
-- once this transaction has committed (store._validate_constraints), without holding this ALTER's
-- ACCESS EXCLUSIVE lock on runs meanwhile. Every existing row satisfies them (the columns are new: '{}'
-- and NULL). Changed after release (0.3.0) for that lock alone: the schema it makes is the same, and a
-- database that applied the first text is not migrated again (tests/integration/test_migrate_operations.py).
ALTER TABLE unitvisor.runs
    ADD COLUMN labels jsonb NOT NULL DEFAULT '{}'::jsonb,
    ADD COLUMN idempotency_key text,
    ADD CONSTRAINT runs_labels_valid CHECK (unitvisor.labels_are_valid(labels)) NOT VALID,
    ADD CONSTRAINT runs_idempotency_key_valid CHECK (
        idempotency_key IS NULL OR (length(idempotency_key) BETWEEN 1 AND 255 AND idempotency_key !~ '[[:cntrl:]]')) NOT VALID;

-- The arbiter of concurrent submits with one key (INSERT ... ON CONFLICT in submit_run).
CREATE UNIQUE INDEX runs_idempotency_key_idx ON unitvisor.runs (idempotency_key) WHERE idempotency_key IS NOT NULL;
-- runs_with_labels' containment (@>): jsonb_path_ops is smaller and faster for @>, the only operator used.
CREATE INDEX runs_labels_idx ON unitvisor.runs USING gin (labels jsonb_path_ops);

-- -- submit_run: one clear error per refused argument ----------------------------------------------
--
-- Until now a refused argument failed on a CHECK constraint of runs, whose DETAIL ("Failing row
-- contains (...)") printed the whole row, environment included, into the caller's logs. Now every
-- argument is checked first, and the first refused one raises a message that names it and says what
-- is allowed. SQLSTATE and constraint name stay those of the constraint (check_violation, or
-- not_null_violation for a NULL where the column has none), so a caller that caught them before still
-- does. No message, detail or hint ever holds a value of the environment, nor any other string the
-- caller passed: those may be secrets pasted in the wrong place. Numbers are echoed; they are not.
--
-- The bounds here repeat those of the constraints in 001_schema.sql; the constraints stay the
-- authority (tests/integration/test_submit.py has a case per constraint, through this function).
--
-- Re-created (new arguments change its signature): DROP and CREATE, then 004's SECURITY DEFINER,
-- search_path, owner (the admin, who runs this migration) and grants again.
DROP FUNCTION unitvisor.submit_run(text[], jsonb, text, text, bigint, integer, integer, integer, bigint,
    integer, text, integer, integer, integer, text[], boolean);
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
    retry_on              text[]  DEFAULT NULL,
    private_network       boolean DEFAULT false,
    idempotency_key       text    DEFAULT NULL,
    labels                jsonb   DEFAULT '{}'::jsonb
) RETURNS uuid
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
-- Bare names in the statements are runs' columns (ON CONFLICT's idempotency_key); the arguments are
-- always written submit_run.<name>.
#variable_conflict use_column
DECLARE
    new_id uuid;
    env jsonb := coalesce(submit_run.environment, '{}'::jsonb);
    run_labels jsonb := coalesce(submit_run.labels, '{}'::jsonb);
    bad_name text;
    refused_constraint text;
    refused_state text;
BEGIN
    -- argv
    IF submit_run.argv IS NULL THEN
        RAISE EXCEPTION 'argv: must not be NULL (an array of text whose first element is an absolute path)'
            USING ERRCODE = 'not_null_violation', SCHEMA = 'unitvisor', TABLE = 'runs', COLUMN = 'argv';
    END IF;
    IF cardinality(submit_run.argv) < 1 OR array_ndims(submit_run.argv) <> 1 OR array_lower(submit_run.argv, 1) <> 1 THEN
        RAISE EXCEPTION 'argv: must be a one-dimensional array of at least one element, indexed from 1'
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs', CONSTRAINT = 'runs_argv_valid';
    END IF;
    IF array_position(submit_run.argv, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'argv: element % is NULL (every element must be text)', array_position(submit_run.argv, NULL)
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs', CONSTRAINT = 'runs_argv_valid';
    END IF;
    IF submit_run.argv[1] NOT LIKE '/%' THEN
        RAISE EXCEPTION 'argv: the first element must be an absolute path (starting with /)'
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs', CONSTRAINT = 'runs_argv_valid',
                  HINT = 'a bare program name would be looked up in systemd''s PATH; give its full path';
    END IF;

    -- environment: names may be echoed only once they are valid names (an invalid one may be a
    -- "NAME=secret" pasted as a name); values never.
    IF jsonb_typeof(env) <> 'object' THEN
        RAISE EXCEPTION 'environment: must be a JSON object of NAME -> string, not a JSON %', jsonb_typeof(env)
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs', CONSTRAINT = 'runs_environment_valid';
    END IF;
    IF EXISTS (SELECT 1 FROM jsonb_object_keys(env) AS e(name) WHERE e.name !~ '^[A-Za-z_][A-Za-z0-9_]{0,127}$') THEN
        RAISE EXCEPTION 'environment: % name(s) are not valid variable names (letters, digits and _, not starting with a digit, 1 to 128 characters)',
            (SELECT count(*) FROM jsonb_object_keys(env) AS e(name) WHERE e.name !~ '^[A-Za-z_][A-Za-z0-9_]{0,127}$')
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs', CONSTRAINT = 'runs_environment_valid';
    END IF;
    SELECT min(e.name) INTO bad_name FROM jsonb_each(env) AS e(name, value) WHERE jsonb_typeof(e.value) <> 'string';
    IF bad_name IS NOT NULL THEN
        RAISE EXCEPTION 'environment: the value of % is not a string (every value must be a JSON string)', bad_name
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs', CONSTRAINT = 'runs_environment_valid';
    END IF;
    SELECT min(e.name) INTO bad_name FROM jsonb_each_text(env) AS e(name, value) WHERE strpos(e.value, E'\n') > 0;
    IF bad_name IS NOT NULL THEN
        RAISE EXCEPTION 'environment: the value of % contains a newline, which systemd and journald take for a record separator', bad_name
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs', CONSTRAINT = 'runs_environment_valid';
    END IF;

    IF submit_run.working_directory IS NOT NULL
            AND (submit_run.working_directory NOT LIKE '/%' OR strpos(submit_run.working_directory, E'\n') > 0) THEN
        RAISE EXCEPTION 'working_directory: must be an absolute path (starting with /) without a newline'
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs',
                  CONSTRAINT = 'runs_working_directory_valid';
    END IF;
    IF submit_run.run_user IS NOT NULL AND submit_run.run_user !~ '^[a-z_][a-z0-9_-]{0,31}$' THEN
        RAISE EXCEPTION 'run_user: is not a user name (lower-case letters, digits, _ and -, not starting with a digit or -, 1 to 32 characters)'
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs', CONSTRAINT = 'runs_run_user_valid';
    END IF;

    -- the numbers: echoed, with their bounds
    IF submit_run.memory_max NOT BETWEEN 1048576 AND 4611686018427387904 THEN
        RAISE EXCEPTION 'memory_max: % is out of range (1048576 to 4611686018427387904 bytes)', submit_run.memory_max
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs', CONSTRAINT = 'runs_memory_max_valid';
    END IF;
    IF submit_run.cpu_quota_percent NOT BETWEEN 1 AND 100000 THEN
        RAISE EXCEPTION 'cpu_quota_percent: % is out of range (1 to 100000 percent of one CPU)', submit_run.cpu_quota_percent
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs', CONSTRAINT = 'runs_cpu_quota_valid';
    END IF;
    IF submit_run.tasks_max NOT BETWEEN 1 AND 4194304 THEN
        RAISE EXCEPTION 'tasks_max: % is out of range (1 to 4194304 tasks)', submit_run.tasks_max
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs', CONSTRAINT = 'runs_tasks_max_valid';
    END IF;
    IF submit_run.io_weight NOT BETWEEN 1 AND 10000 THEN
        RAISE EXCEPTION 'io_weight: % is out of range (1 to 10000)', submit_run.io_weight
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs', CONSTRAINT = 'runs_io_weight_valid';
    END IF;
    IF submit_run.runtime_max_sec NOT BETWEEN 1 AND 315360000 THEN
        RAISE EXCEPTION 'runtime_max_sec: % is out of range (1 to 315360000 seconds)', submit_run.runtime_max_sec
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs', CONSTRAINT = 'runs_runtime_max_valid';
    END IF;
    -- Arguments whose columns are NOT NULL: an explicit NULL is refused as the column refused it.
    IF submit_run.max_attempts IS NULL THEN
        RAISE EXCEPTION 'max_attempts: must not be NULL (1 to 1000; the default is 1)'
            USING ERRCODE = 'not_null_violation', SCHEMA = 'unitvisor', TABLE = 'runs', COLUMN = 'max_attempts';
    END IF;
    IF submit_run.max_attempts NOT BETWEEN 1 AND 1000 THEN
        RAISE EXCEPTION 'max_attempts: % is out of range (1 to 1000)', submit_run.max_attempts
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs', CONSTRAINT = 'runs_max_attempts_valid';
    END IF;
    IF submit_run.priority IS NULL THEN
        RAISE EXCEPTION 'priority: must not be NULL (any integer; the default is 0)'
            USING ERRCODE = 'not_null_violation', SCHEMA = 'unitvisor', TABLE = 'runs', COLUMN = 'priority';
    END IF;
    IF submit_run.retry_backoff_sec IS NULL OR submit_run.retry_backoff_max_sec IS NULL THEN
        RAISE EXCEPTION '%: must not be NULL (the defaults are 10 and 600 seconds)',
            CASE WHEN submit_run.retry_backoff_sec IS NULL THEN 'retry_backoff_sec' ELSE 'retry_backoff_max_sec' END
            USING ERRCODE = 'not_null_violation', SCHEMA = 'unitvisor', TABLE = 'runs';
    END IF;
    IF submit_run.retry_backoff_sec NOT BETWEEN 0 AND 86400 THEN
        RAISE EXCEPTION 'retry_backoff_sec: % is out of range (0 to 86400 seconds)', submit_run.retry_backoff_sec
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs', CONSTRAINT = 'runs_backoff_valid';
    END IF;
    IF submit_run.retry_backoff_max_sec NOT BETWEEN submit_run.retry_backoff_sec AND 604800 THEN
        RAISE EXCEPTION 'retry_backoff_max_sec: % is out of range (retry_backoff_sec, here %, to 604800 seconds)',
            submit_run.retry_backoff_max_sec, submit_run.retry_backoff_sec
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs', CONSTRAINT = 'runs_backoff_valid';
    END IF;
    IF NOT submit_run.retry_on <@ ARRAY['exit-code', 'signal', 'core-dump', 'timeout', 'oom-kill', 'watchdog',
                                         'start-failed', 'lost']::text[]
            OR array_position(submit_run.retry_on, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'retry_on: may hold only exit-code, signal, core-dump, timeout, oom-kill, watchdog, start-failed and lost'
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs', CONSTRAINT = 'runs_retry_on_valid';
    END IF;

    IF NOT unitvisor.labels_are_valid(run_labels) THEN
        RAISE EXCEPTION 'labels: must be a JSON object of at most 64 key -> string pairs; a key is 1 to 63 letters, digits, ".", "_", "-" and "/", starting and ending with a letter or digit; a value is at most 255 characters, without control characters'
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs', CONSTRAINT = 'runs_labels_valid';
    END IF;
    IF submit_run.idempotency_key IS NOT NULL AND (length(submit_run.idempotency_key) NOT BETWEEN 1 AND 255
                                                   OR submit_run.idempotency_key ~ '[[:cntrl:]]') THEN
        RAISE EXCEPTION 'idempotency_key: must be 1 to 255 characters without control characters (or NULL: none)'
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs',
                  CONSTRAINT = 'runs_idempotency_key_valid';
    END IF;

    -- A retried submit: the run its key made, whatever the other arguments say now (as Stripe's and
    -- River's idempotency keys: the key names the request, the first one wins). Nothing is written.
    IF submit_run.idempotency_key IS NOT NULL THEN
        SELECT r.id INTO new_id FROM unitvisor.runs r WHERE r.idempotency_key = submit_run.idempotency_key;
        IF FOUND THEN
            RETURN new_id;
        END IF;
    END IF;

    -- A constraint this function did not foresee (one added later) must not leak the row either:
    -- caught, and raised again with its name but without the DETAIL that holds the row.
    BEGIN
        INSERT INTO unitvisor.runs (argv, environment, working_directory, run_user, memory_max,
            cpu_quota_percent, tasks_max, io_weight, runtime_max_sec, max_attempts, host_pin, priority,
            retry_backoff_sec, retry_backoff_max_sec, retry_on, private_network, idempotency_key, labels)
        VALUES (submit_run.argv, env, submit_run.working_directory,
            submit_run.run_user, submit_run.memory_max, submit_run.cpu_quota_percent, submit_run.tasks_max,
            submit_run.io_weight, submit_run.runtime_max_sec, submit_run.max_attempts, submit_run.host_pin,
            submit_run.priority, submit_run.retry_backoff_sec, submit_run.retry_backoff_max_sec,
            submit_run.retry_on, coalesce(submit_run.private_network, false), submit_run.idempotency_key,
            run_labels)
        -- Another submit with the same key committed since the look-up above (this waited for it):
        -- insert nothing, and return its run below.
        ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
        RETURNING id INTO new_id;
        IF new_id IS NULL THEN
            SELECT r.id INTO STRICT new_id FROM unitvisor.runs r WHERE r.idempotency_key = submit_run.idempotency_key;
            RETURN new_id;
        END IF;
        INSERT INTO unitvisor.spawn_jobs (run_id, priority) VALUES (new_id, submit_run.priority);
        INSERT INTO unitvisor.run_events (run_id, state, reason) VALUES (new_id, 'queued', 'submitted');
    EXCEPTION WHEN integrity_constraint_violation THEN
        GET STACKED DIAGNOSTICS refused_constraint = CONSTRAINT_NAME, refused_state = RETURNED_SQLSTATE;
        RAISE EXCEPTION 'the run was refused by constraint %', coalesce(nullif(refused_constraint, ''), '(unnamed)')
            USING ERRCODE = refused_state, CONSTRAINT = coalesce(refused_constraint, '');
    END;
    RETURN new_id;
END $$;

REVOKE EXECUTE ON FUNCTION unitvisor.submit_run(text[], jsonb, text, text, bigint, integer, integer, integer,
    bigint, integer, text, integer, integer, integer, text[], boolean, text, jsonb) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.submit_run(text[], jsonb, text, text, bigint, integer, integer, integer,
    bigint, integer, text, integer, integer, integer, text[], boolean, text, jsonb) TO unitvisor_submitter;

-- -- run_status: what a control plane asks about a run ---------------------------------------------
--
-- One row (none: no such run, or not one the caller may see), from the caller's own snapshot, so it
-- can be read inside the transaction that submitted the run. Invoker's rights: it reads what the
-- caller may read anyway (submitter and admin read every run). The latest attempt's columns are NULL
-- until a host has claimed the run; wait_reason is why a queued run has not started
-- (explain_waiting), NULL otherwise. `unitvisor wait` reads a run's state through it.
CREATE FUNCTION unitvisor.run_status(run_id uuid)
RETURNS TABLE (id uuid, state text, created_at timestamptz, finished_at timestamptz, attempts integer,
               attempt integer, host_id text, outcome text, exit_status text, reason text,
               cancel_requested boolean, wait_reason text, labels jsonb)
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT r.id, r.state, r.created_at, r.finished_at,
        (SELECT count(*)::integer FROM unitvisor.attempts c WHERE c.run_id = r.id),
        a.attempt, a.host_id, a.outcome, a.exit_status, a.reason,
        r.cancel_requested_at IS NOT NULL,
        CASE WHEN r.state = 'queued' THEN (SELECT w.reason FROM unitvisor.run_waits w WHERE w.run_id = r.id) END,
        r.labels
    FROM unitvisor.runs r
    LEFT JOIN LATERAL (
        SELECT l.attempt, l.host_id, l.outcome, l.exit_status, l.reason FROM unitvisor.attempts l
        WHERE l.run_id = r.id ORDER BY l.attempt DESC LIMIT 1) a ON true
    WHERE r.id = run_status.run_id
$$;

REVOKE EXECUTE ON FUNCTION unitvisor.run_status(uuid) FROM PUBLIC;
-- Also to hosts: it runs with the caller's rights, so a host reads through the policy on runs only
-- what it may see, and `unitvisor wait` works with a host's own DSN (README, Roles).
GRANT EXECUTE ON FUNCTION unitvisor.run_status(uuid) TO unitvisor_submitter, unitvisor_host;

-- The status (run_status's columns) of every run that carries all the given labels (its labels @> the
-- argument; '{}' matches every run), newest first, at most max_rows of them. A filter that is not a
-- JSON object matches no run. Invoker's rights, as run_status. (LANGUAGE sql: in PL/pgSQL the argument
-- labels and the result column labels would be one variable.)
CREATE FUNCTION unitvisor.runs_with_labels(labels jsonb, max_rows integer DEFAULT 100)
RETURNS TABLE (id uuid, state text, created_at timestamptz, finished_at timestamptz, attempts integer,
               attempt integer, host_id text, outcome text, exit_status text, reason text,
               cancel_requested boolean, wait_reason text, labels jsonb)
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT s.* FROM (SELECT r.id AS run_id, r.created_at AS run_created_at FROM unitvisor.runs r
                     WHERE r.labels @> runs_with_labels.labels
                     ORDER BY r.created_at DESC, r.id LIMIT runs_with_labels.max_rows) m
    CROSS JOIN LATERAL unitvisor.run_status(m.run_id) s
    ORDER BY m.run_created_at DESC, m.run_id
$$;
REVOKE EXECUTE ON FUNCTION unitvisor.runs_with_labels(jsonb, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.runs_with_labels(jsonb, integer) TO unitvisor_submitter, unitvisor_host;

-- -- the completion signal: NOTIFY unitvisor_run_finished ------------------------------------------
--
-- Whenever a run reaches succeeded, failed or cancelled (by any path: an outcome, a cancel of a
-- queued run, an admin's UPDATE), one notification on the documented channel unitvisor_run_finished
-- with the payload {"run_id": "<uuid>", "state": "<terminal state>"}. NOTIFY is delivered at commit,
-- so a listener never hears of a state the database does not have yet; a rolled-back change sends
-- nothing. A run resumed and finished again notifies again. (As for any NOTIFY, identical payloads in
-- one transaction are delivered once.) A listener still re-reads run_status after (re)connecting:
-- notifications sent while it was not listening are not replayed.
CREATE FUNCTION unitvisor.notify_run_finished() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM pg_notify('unitvisor_run_finished',
                      json_build_object('run_id', NEW.id, 'state', NEW.state)::text);
    RETURN NULL;
END $$;
REVOKE EXECUTE ON FUNCTION unitvisor.notify_run_finished() FROM PUBLIC;

CREATE TRIGGER runs_notify_finished AFTER UPDATE OF state ON unitvisor.runs
    FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state AND NEW.state IN ('succeeded', 'failed', 'cancelled'))
    EXECUTE FUNCTION unitvisor.notify_run_finished();

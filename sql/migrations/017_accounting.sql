-- unitvisor schema, version 17 (issue 22): the accounting's missing figure, the peak number of tasks
-- of an attempt, and a run's memory_high (systemd's MemoryHigh=: throttled before it is killed).
--
-- Expand only, for 0.6.x daemons and CLIs: two nullable columns (every release reads rows by explicit
-- column lists), record_outcome an overload with one more argument (the 17-argument form that 0.6.0
-- daemons call by position keeps its signature and grants, and now hands over to the new one with a
-- NULL, so that the outcome logic exists once, as 007 and 013 did), and submit_run one more argument,
-- last and defaulted, so that every call written for an earlier schema (positional or named) keeps
-- its meaning.

-- -- tasks_peak ---------------------------------------------------------------------------------------
--
-- The most tasks (processes and threads) the attempt's unit had at once: the kernel's pids.peak of its
-- cgroup (Linux 6.1 and later, cgroup v2), copied by the unit's own ExecStopPost= before systemd
-- removes the cgroup (supervisor/taskspeak.py says how). NULL: not measured (a cgroup v1 host, a kernel
-- without pids.peak, a unit of a 0.6.x daemon, an outcome recorded without the unit), never 0
-- for "unknown". 007 left the column out because systemd keeps no such figure of an ended unit; the
-- kernel has one while the cgroup exists, and that is where it is now read.
ALTER TABLE unitvisor.attempts
    ADD COLUMN tasks_peak bigint,
    -- 007's constraint with the new column, under the same name (record_outcome's error names it): NOT
    -- VALID, validated by `unitvisor migrate` after this transaction commits (as 007's was).
    DROP CONSTRAINT attempts_accounting_valid,
    ADD CONSTRAINT attempts_accounting_valid CHECK (
        cpu_usage_nsec >= 0 AND memory_peak_bytes >= 0 AND io_read_bytes >= 0 AND io_write_bytes >= 0
        AND tasks_peak >= 0) NOT VALID;

-- -- memory_high ----------------------------------------------------------------------------------------
--
-- The run's MemoryHigh=: over it the kernel reclaims the run's memory and throttles its allocations,
-- never kills it (memory_max, MemoryMax=, still does). Bounds as memory_max's; not above memory_max.
-- NULL: none. A 0.6.x daemon ignores the column (it reads runs by its own column list) and starts such
-- a run without the throttle: README, Upgrade, says to upgrade every host.
ALTER TABLE unitvisor.runs
    ADD COLUMN memory_high bigint,
    ADD CONSTRAINT runs_memory_high_valid CHECK (
        memory_high BETWEEN 1048576 AND 4611686018427387904 AND (memory_max IS NULL OR memory_high <= memory_max))
        NOT VALID;

-- -- record_outcome -------------------------------------------------------------------------------------

-- As 013's, with tasks_peak, written in the same UPDATE as the rest of the accounting.
CREATE FUNCTION unitvisor.record_outcome(
    run_id uuid, attempt integer, host_id text, host_epoch bigint, outcome text, exit_status text,
    reason text, next_state text, retry_delay interval, invocation_id text, started_at timestamptz,
    ended_at timestamptz, cpu_usage_nsec bigint, memory_peak_bytes bigint, io_read_bytes bigint,
    io_write_bytes bigint, host_clock timestamptz, tasks_peak bigint) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    latest integer;
    state_after text := record_outcome.next_state;
    delay interval := record_outcome.retry_delay;
    detail text;
    target unitvisor.attempts;
    run unitvisor.runs;
    writer unitvisor.hosts;
    policy_state text;
    clock_offset interval := statement_timestamp() - record_outcome.host_clock;
    start_time timestamptz;
BEGIN
    PERFORM unitvisor.check_fence(record_outcome.host_id, record_outcome.host_epoch);
    IF state_after NOT IN ('queued', 'succeeded', 'failed', 'cancelled') OR (state_after = 'queued') <> (delay IS NOT NULL) THEN
        RAISE EXCEPTION 'an outcome moves its run to succeeded, failed or cancelled, or to queued with a retry delay'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- Checked here, before the UPDATE, so that the error names the arguments.
    IF least(record_outcome.cpu_usage_nsec, record_outcome.memory_peak_bytes, record_outcome.io_read_bytes,
             record_outcome.io_write_bytes, record_outcome.tasks_peak) < 0 THEN
        RAISE EXCEPTION 'cpu_usage_nsec, memory_peak_bytes, io_read_bytes, io_write_bytes and tasks_peak: must be NULL (not measured) or at least 0'
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'attempts',
                  CONSTRAINT = 'attempts_accounting_valid';
    END IF;
    SELECT * INTO target FROM unitvisor.attempts a
    WHERE a.run_id = record_outcome.run_id AND a.attempt = record_outcome.attempt AND a.outcome IS NULL
    FOR UPDATE;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF target.host_id <> record_outcome.host_id THEN
        IF NOT EXISTS (SELECT 1 FROM unitvisor.hosts h WHERE h.id = target.host_id AND h.state = 'dead') THEN
            RETURN false;  -- another host's, and that host is not dead: not this one's to settle
        END IF;
        SELECT * INTO writer FROM unitvisor.hosts h WHERE h.id = record_outcome.host_id;
        SELECT * INTO run FROM unitvisor.runs r WHERE r.id = record_outcome.run_id;
        IF NOT unitvisor.host_acts_for_fleet(writer) THEN
            RAISE EXCEPTION 'host % may not settle attempt % of run % of dead host %: it is not live itself (%, heard from % s ago)',
                record_outcome.host_id, record_outcome.attempt, record_outcome.run_id, target.host_id, writer.state,
                round(extract(epoch FROM now() - writer.heartbeat_at)::numeric)
                USING ERRCODE = 'insufficient_privilege',
                      HINT = 'only a live host settles the attempts of a host declared dead';
        END IF;
        policy_state := CASE WHEN record_outcome.attempt < run.max_attempts
                                  AND (run.retry_on IS NULL OR 'lost' = ANY (run.retry_on))
                             THEN 'queued' ELSE 'failed' END;
        IF record_outcome.exit_status IS NOT NULL
                OR NOT ((record_outcome.outcome = 'lost'
                         AND (state_after = policy_state
                              OR (run.cancel_requested_at IS NOT NULL AND state_after = 'cancelled')))
                        OR (record_outcome.outcome = 'cancelled' AND state_after = 'cancelled'
                            AND run.cancel_requested_at IS NOT NULL)) THEN
            RAISE EXCEPTION 'host % may not settle attempt % of run % of dead host % as % (%) moving the run to %: a peer records only lost, with no exit status, the run moved on by its own policy (here %), or cancelled when a cancel was requested',
                record_outcome.host_id, record_outcome.attempt, record_outcome.run_id, target.host_id,
                record_outcome.outcome, coalesce(record_outcome.exit_status, 'no exit status'), state_after,
                policy_state
                USING ERRCODE = 'insufficient_privilege',
                      HINT = 'how the attempt of a dead host ended is not known: docs/fleet.md, Dead hosts';
        END IF;
    END IF;
    -- A unit seen only once it had ended (adopted after a crash) did start.
    start_time := CASE WHEN record_outcome.invocation_id IS NULL AND record_outcome.started_at IS NULL
                       THEN target.started_at
                       ELSE coalesce(target.started_at,
                                     unitvisor.host_time_on_db_clock(record_outcome.started_at, clock_offset,
                                                                     target.claimed_at, statement_timestamp()),
                                     now()) END;
    UPDATE unitvisor.attempts a SET outcome = record_outcome.outcome, exit_status = record_outcome.exit_status,
        reason = record_outcome.reason,
        ended_at = coalesce(unitvisor.host_time_on_db_clock(record_outcome.ended_at, clock_offset,
                                                            coalesce(start_time, a.claimed_at), statement_timestamp()),
                            greatest(now(), start_time)),
        invocation_id = coalesce(a.invocation_id, record_outcome.invocation_id),
        started_at = start_time,
        cpu_usage_nsec = record_outcome.cpu_usage_nsec, memory_peak_bytes = record_outcome.memory_peak_bytes,
        io_read_bytes = record_outcome.io_read_bytes, io_write_bytes = record_outcome.io_write_bytes,
        tasks_peak = record_outcome.tasks_peak
    WHERE a.run_id = record_outcome.run_id AND a.attempt = record_outcome.attempt;
    SELECT max(a.attempt) INTO latest FROM unitvisor.attempts a WHERE a.run_id = record_outcome.run_id;
    IF latest <> record_outcome.attempt THEN
        RETURN true;  -- an older attempt settled late; the run follows its newest attempt
    END IF;
    detail := format('attempt %s: %s (%s)', record_outcome.attempt, record_outcome.outcome, record_outcome.reason);
    IF delay IS NOT NULL AND (SELECT r.cancel_requested_at IS NOT NULL FROM unitvisor.runs r
                              WHERE r.id = record_outcome.run_id FOR UPDATE) THEN
        -- Cancelled while this outcome was on its way: the operator's word ends the run.
        delay := NULL;
        state_after := 'cancelled';
        detail := detail || '; no retry, a cancel was requested';
    END IF;
    IF delay IS NOT NULL THEN
        INSERT INTO unitvisor.spawn_jobs (run_id, priority, scheduled_at)
        SELECT r.id, r.priority, now() + delay FROM unitvisor.runs r WHERE r.id = record_outcome.run_id;
        -- round() of a double rounds half to even, as Python's format did before this moved here
        detail := detail || format('; retry in %ss', round(extract(epoch FROM delay)::double precision));
    END IF;
    UPDATE unitvisor.runs r SET state = state_after, updated_at = now(),
        finished_at = CASE WHEN state_after IN ('succeeded', 'failed', 'cancelled') THEN now() END
    WHERE r.id = record_outcome.run_id;
    INSERT INTO unitvisor.run_events (run_id, attempt, host_id, state, reason)
    VALUES (record_outcome.run_id, record_outcome.attempt, record_outcome.host_id, state_after, detail);
    RETURN true;
END $$;

REVOKE EXECUTE ON FUNCTION unitvisor.record_outcome(uuid, integer, text, bigint, text, text, text, text, interval,
    text, timestamptz, timestamptz, bigint, bigint, bigint, bigint, timestamptz, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.record_outcome(uuid, integer, text, bigint, text, text, text, text, interval,
    text, timestamptz, timestamptz, bigint, bigint, bigint, bigint, timestamptz, bigint) TO unitvisor_host;

-- The 17-argument form (0.6.x daemons): the same outcome, no tasks peak. Replaced in place, so that its
-- grants stay; the 16- and 12-argument forms reach it, and so this one body.
CREATE OR REPLACE FUNCTION unitvisor.record_outcome(
    run_id uuid, attempt integer, host_id text, host_epoch bigint, outcome text, exit_status text,
    reason text, next_state text, retry_delay interval, invocation_id text, started_at timestamptz,
    ended_at timestamptz, cpu_usage_nsec bigint, memory_peak_bytes bigint, io_read_bytes bigint,
    io_write_bytes bigint, host_clock timestamptz) RETURNS boolean
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT unitvisor.record_outcome($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17,
                                    NULL::bigint)
$$;

-- -- submit_run: memory_high --------------------------------------------------------------------------
--
-- As in 015, with memory_high last and defaulted. DROP and CREATE (the signature changes), then the
-- grants again, as 006 did.
DROP FUNCTION unitvisor.submit_run(text[], jsonb, text, text, bigint, integer, integer, integer, bigint,
    integer, text, integer, integer, integer, text[], boolean, text, jsonb, text, timestamptz, timestamptz);
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
    labels                jsonb   DEFAULT '{}'::jsonb,
    concurrency_key       text    DEFAULT NULL,
    not_before            timestamptz DEFAULT NULL,
    start_deadline        timestamptz DEFAULT NULL,
    memory_high           bigint  DEFAULT NULL
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
    -- memory_high: a quantity as memory_max is, and never above it (systemd would take a MemoryHigh=
    -- above MemoryMax= and never reach it: the run would be killed before it is throttled, which is not
    -- what its submitter asked for).
    IF submit_run.memory_high NOT BETWEEN 1048576 AND 4611686018427387904 THEN
        RAISE EXCEPTION 'memory_high: % is out of range (1048576 to 4611686018427387904 bytes)', submit_run.memory_high
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs', CONSTRAINT = 'runs_memory_high_valid';
    END IF;
    IF submit_run.memory_high > submit_run.memory_max THEN
        RAISE EXCEPTION 'memory_high: % is above memory_max (%): a run is throttled at memory_high before it is killed at memory_max',
            submit_run.memory_high, submit_run.memory_max
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs', CONSTRAINT = 'runs_memory_high_valid';
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

    IF submit_run.concurrency_key IS NOT NULL AND (length(submit_run.concurrency_key) NOT BETWEEN 1 AND 255
                                                   OR submit_run.concurrency_key ~ '[[:cntrl:]]') THEN
        RAISE EXCEPTION 'concurrency_key: must be 1 to 255 characters without control characters (or NULL: none)'
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs',
                  CONSTRAINT = 'runs_concurrency_key_valid';
    END IF;
    IF NOT isfinite(submit_run.not_before) THEN
        RAISE EXCEPTION 'not_before: must be a finite time (or NULL: as soon as possible)'
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs', CONSTRAINT = 'runs_not_before_valid';
    END IF;
    IF NOT isfinite(submit_run.start_deadline) THEN
        RAISE EXCEPTION 'start_deadline: must be a finite time (or NULL: none)'
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs',
                  CONSTRAINT = 'runs_start_deadline_valid';
    END IF;
    IF submit_run.start_deadline <= submit_run.not_before THEN
        RAISE EXCEPTION 'start_deadline: must be later than not_before (a run cannot have to start before it may)'
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs',
                  CONSTRAINT = 'runs_start_deadline_valid';
    END IF;

    -- Sizes, once every argument has its form (so that a name it echoes is a valid name): one helper
    -- holds every bound, so that a later submit_run calls it instead of repeating them.
    PERFORM unitvisor.check_run_sizes(submit_run.argv, env, submit_run.working_directory, submit_run.host_pin,
                                      submit_run.retry_on);

    -- A retried submit: the run its key made, whatever the other arguments say now (as Stripe's and
    -- River's idempotency keys: the key names the request, the first one wins). Nothing is written.
    IF submit_run.idempotency_key IS NOT NULL THEN
        SELECT r.id INTO new_id FROM unitvisor.runs r WHERE r.idempotency_key = submit_run.idempotency_key;
        IF FOUND THEN
            RETURN new_id;
        END IF;
    END IF;

    -- Checked after the look-up: a retried submit must find its run even once its deadline has passed.
    -- now() is the database's clock (the transaction's start), not the caller's.
    IF submit_run.start_deadline <= now() THEN
        RAISE EXCEPTION 'start_deadline: must be in the future (it is not after the database''s now())'
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs',
                  CONSTRAINT = 'runs_start_deadline_valid';
    END IF;

    -- A constraint this function did not foresee (one added later) must not leak the row either:
    -- caught, and raised again with its name but without the DETAIL that holds the row.
    BEGIN
        INSERT INTO unitvisor.runs (argv, environment, working_directory, run_user, memory_max,
            cpu_quota_percent, tasks_max, io_weight, runtime_max_sec, max_attempts, host_pin, priority,
            retry_backoff_sec, retry_backoff_max_sec, retry_on, private_network, idempotency_key, labels,
            concurrency_key, not_before, start_deadline, memory_high)
        VALUES (submit_run.argv, env, submit_run.working_directory,
            submit_run.run_user, submit_run.memory_max, submit_run.cpu_quota_percent, submit_run.tasks_max,
            submit_run.io_weight, submit_run.runtime_max_sec, submit_run.max_attempts, submit_run.host_pin,
            submit_run.priority, submit_run.retry_backoff_sec, submit_run.retry_backoff_max_sec,
            submit_run.retry_on, coalesce(submit_run.private_network, false), submit_run.idempotency_key,
            run_labels, submit_run.concurrency_key, submit_run.not_before, submit_run.start_deadline,
            submit_run.memory_high)
        -- Another submit with the same key committed since the look-up above (this waited for it):
        -- insert nothing, and return its run below.
        ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
        RETURNING id INTO new_id;
        IF new_id IS NULL THEN
            SELECT r.id INTO STRICT new_id FROM unitvisor.runs r WHERE r.idempotency_key = submit_run.idempotency_key;
            RETURN new_id;
        END IF;
        -- not_before: the first job is not due before it (the claim takes only due jobs).
        INSERT INTO unitvisor.spawn_jobs (run_id, priority, scheduled_at)
        VALUES (new_id, submit_run.priority, greatest(now(), submit_run.not_before));
        INSERT INTO unitvisor.run_events (run_id, state, reason) VALUES (new_id, 'queued', 'submitted');
    EXCEPTION WHEN integrity_constraint_violation THEN
        GET STACKED DIAGNOSTICS refused_constraint = CONSTRAINT_NAME, refused_state = RETURNED_SQLSTATE;
        RAISE EXCEPTION 'the run was refused by constraint %', coalesce(nullif(refused_constraint, ''), '(unnamed)')
            USING ERRCODE = refused_state, CONSTRAINT = coalesce(refused_constraint, '');
    END;
    RETURN new_id;
END $$;

REVOKE EXECUTE ON FUNCTION unitvisor.submit_run(text[], jsonb, text, text, bigint, integer, integer, integer,
    bigint, integer, text, integer, integer, integer, text[], boolean, text, jsonb, text, timestamptz,
    timestamptz, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.submit_run(text[], jsonb, text, text, bigint, integer, integer, integer,
    bigint, integer, text, integer, integer, integer, text[], boolean, text, jsonb, text, timestamptz,
    timestamptz, bigint) TO unitvisor_submitter;

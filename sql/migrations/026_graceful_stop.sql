-- unitvisor schema 26 (issue 25, item 5): graceful stop.
--
-- A run says how it is stopped and warned: stop_signal (the unit's KillSignal=, default TERM),
-- stop_timeout (its TimeoutStopSec=, in seconds, then SIGKILL), and warn_before with warn_signal (sent
-- by the run's host that many seconds before runtime_max_sec ends the run, so that it can checkpoint:
-- Slurm's --signal). A cancel stops the unit the same way. Four columns of runs, four arguments at the
-- end of submit_run (and of run_argument_problem, whose block at its end checks them), one column of
-- attempts (warned_at: the warning is sent once per attempt, also across a daemon's restart) and the
-- host's function that sets it (mark_warned).
--
-- Expand only, for 0.8.0 daemons and CLIs (README, "Upgrade"): the new columns are NULL by default and
-- mean what a run meant before (systemd's defaults, no warning); submit_run's new arguments come last,
-- with defaults, so that every call of 0.8.0's, positional or named, means what it did; claim_jobs'
-- result is unchanged. A 0.8.0 daemon ignores the columns: a run submitted with them is stopped with
-- SIGTERM after systemd's default timeout and never warned there, until its host is upgraded.

-- The signals a run may name for its stop_signal and warn_signal (schema 026), short (no SIG): those a
-- program may catch to stop or checkpoint, and KILL. Not STOP, CONT, or the ones the kernel sends on a
-- fault (SEGV, BUS, ...): a stop by them would not be a stop. supervisor/stopsignals.py holds the same
-- list (a test compares them).
CREATE FUNCTION unitvisor.stop_signal_names() RETURNS text[]
LANGUAGE sql IMMUTABLE AS $$
    SELECT ARRAY['TERM', 'INT', 'HUP', 'QUIT', 'USR1', 'USR2', 'ALRM', 'WINCH', 'KILL']
$$;

-- A signal's name as runs keep it: upper case, without SIG ('sigterm' -> 'TERM'). NULL stays NULL.
CREATE FUNCTION unitvisor.signal_short_name(name text) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN upper(name) LIKE 'SIG%' THEN substr(upper(name), 4) ELSE upper(name) END
$$;

ALTER TABLE unitvisor.runs
    ADD COLUMN stop_signal  text,
    ADD COLUMN stop_timeout integer,
    ADD COLUMN warn_before  integer,
    ADD COLUMN warn_signal  text;

ALTER TABLE unitvisor.attempts ADD COLUMN warned_at timestamptz;

-- The checks, with the graceful stop's block at the end (the arguments too): a new signature, so the
-- old one is dropped. Nothing depends on it but the PL/pgSQL of the two functions below, replaced here.
DROP FUNCTION unitvisor.run_argument_problem(text[], jsonb, text, text, bigint, bigint, integer, integer, integer, bigint, integer, integer, integer, text[], jsonb, text, text, timestamptz, timestamptz);

CREATE FUNCTION unitvisor.run_argument_problem(
    argv text[], environment jsonb, working_directory text, run_user text, memory_max bigint,
    memory_high bigint, cpu_quota_percent integer, tasks_max integer, io_weight integer,
    runtime_max_sec bigint, max_attempts integer, retry_backoff_sec integer, retry_backoff_max_sec integer,
    retry_on text[], labels jsonb, idempotency_key text, concurrency_key text, not_before timestamptz,
    start_deadline timestamptz, stop_signal text, stop_timeout integer, warn_before integer,
    warn_signal text, OUT constraint_name text, OUT message text, OUT hint text)
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    -- What a run may be retried after: it names the outcomes of unitvisor.attempts.
    retryable CONSTANT text[] := ARRAY['exit-code', 'signal', 'core-dump', 'timeout', 'oom-kill', 'watchdog',
                                       'start-failed', 'lost'];
    -- Memory: below 1 MiB nothing starts at all; the upper end is what the kernel and systemd accept.
    memory_min CONSTANT bigint := 1048576;
    memory_top CONSTANT bigint := 4611686018427387904;
    backoff_top CONSTANT integer := 604800;
    problem text;
    bound record;
BEGIN
    -- argv[0] must be absolute: a bare name would be looked up in systemd's PATH, and the host
    -- allowlist could not say which binary it allowed. One dimension, indexed from 1: an array like
    -- '[2:3]={sh,-c}' has no argv[1] to check.
    IF cardinality(argv) < 1 OR array_ndims(argv) <> 1 OR array_lower(argv, 1) <> 1 THEN
        constraint_name := 'runs_argv_valid';
        message := 'argv: must be a one-dimensional array of at least one element, indexed from 1';
    ELSIF array_position(argv, NULL) IS NOT NULL THEN
        constraint_name := 'runs_argv_valid';
        message := format('argv: element %s is NULL (every element must be text)', array_position(argv, NULL));
    ELSIF argv[1] NOT LIKE '/%' THEN
        constraint_name := 'runs_argv_valid';
        message := 'argv: the first element must be an absolute path (starting with /)';
        hint := 'a bare program name would be looked up in systemd''s PATH; give its full path';
    END IF;
    IF message IS NOT NULL THEN
        RETURN;
    END IF;

    problem := unitvisor.environment_problem(environment);
    IF problem IS NOT NULL THEN
        constraint_name := 'runs_environment_valid';
        message := problem;
    ELSIF working_directory NOT LIKE '/%' OR strpos(working_directory, E'\n') > 0 THEN
        constraint_name := 'runs_working_directory_valid';
        message := 'working_directory: must be an absolute path (starting with /) without a newline';
    ELSIF run_user !~ '^[a-z_][a-z0-9_-]{0,31}$' THEN
        constraint_name := 'runs_run_user_valid';
        message := 'run_user: is not a user name (lower-case letters, digits, _ and -, not starting with a digit or -, 1 to 32 characters)';
    END IF;
    IF message IS NOT NULL THEN
        RETURN;
    END IF;

    -- The numbers, echoed with their bounds: the upper ends are what the kernel and systemd accept. A
    -- value outside a bound is a typo, and refusing it at insert time is kinder than a unit that fails
    -- to start.
    SELECT b.argument, b.value, b.low, b.high, b.unit, b.constraint_name INTO bound
    FROM (VALUES (1, 'memory_max', memory_max, memory_min, memory_top, ' bytes', 'runs_memory_max_valid'),
                 (2, 'memory_high', memory_high, memory_min, memory_top, ' bytes', 'runs_memory_high_valid'),
                 (3, 'cpu_quota_percent', cpu_quota_percent::bigint, 1, 100000, ' percent of one CPU', 'runs_cpu_quota_valid'),
                 (4, 'tasks_max', tasks_max, 1, 4194304, ' tasks', 'runs_tasks_max_valid'),
                 (5, 'io_weight', io_weight, 1, 10000, '', 'runs_io_weight_valid'),
                 (6, 'runtime_max_sec', runtime_max_sec, 1, 315360000, ' seconds', 'runs_runtime_max_valid'),
                 (7, 'max_attempts', max_attempts, 1, 1000, '', 'runs_max_attempts_valid'),
                 (8, 'retry_backoff_sec', retry_backoff_sec, 0, 86400, ' seconds', 'runs_backoff_valid'))
         AS b(place, argument, value, low, high, unit, constraint_name)
    WHERE b.value NOT BETWEEN b.low AND b.high
    ORDER BY b.place LIMIT 1;
    IF FOUND THEN
        constraint_name := bound.constraint_name;
        message := format('%s: %s is out of range (%s to %s%s)', bound.argument, bound.value, bound.low, bound.high,
                          bound.unit);
    -- memory_high: never above memory_max (systemd would take a MemoryHigh= above MemoryMax= and never
    -- reach it: the run would be killed before it is throttled, which is not what its submitter asked for).
    ELSIF memory_high > memory_max THEN
        constraint_name := 'runs_memory_high_valid';
        message := format('memory_high: %s is above memory_max (%s): a run is throttled at memory_high before it is killed at memory_max',
                          memory_high, memory_max);
    ELSIF retry_backoff_max_sec NOT BETWEEN retry_backoff_sec AND backoff_top THEN
        constraint_name := 'runs_backoff_valid';
        message := format('retry_backoff_max_sec: %s is out of range (retry_backoff_sec, here %s, to %s seconds)',
                          retry_backoff_max_sec, retry_backoff_sec, backoff_top);
    -- A NULL element is in no array (<@ compares with =), so it is refused too.
    ELSIF NOT retry_on <@ retryable THEN
        constraint_name := 'runs_retry_on_valid';
        message := 'retry_on: may hold only ' || array_to_string(retryable[1:cardinality(retryable) - 1], ', ')
                   || ' and ' || retryable[cardinality(retryable)];

    ELSIF NOT unitvisor.labels_are_valid(labels) THEN
        constraint_name := 'runs_labels_valid';
        message := 'labels: must be a JSON object of at most 64 key -> string pairs; a key is 1 to 63 letters, digits, ".", "_", "-" and "/", starting and ending with a letter or digit; a value is at most 255 characters, without control characters';
    -- The caller's own strings: bounded, one line.
    ELSIF length(idempotency_key) NOT BETWEEN 1 AND 255 OR idempotency_key ~ '[[:cntrl:]]' THEN
        constraint_name := 'runs_idempotency_key_valid';
        message := 'idempotency_key: must be 1 to 255 characters without control characters (or NULL: none)';
    ELSIF length(concurrency_key) NOT BETWEEN 1 AND 255 OR concurrency_key ~ '[[:cntrl:]]' THEN
        constraint_name := 'runs_concurrency_key_valid';
        message := 'concurrency_key: must be 1 to 255 characters without control characters (or NULL: none)';
    -- 'infinity' is no time: a not_before of infinity would never start, a deadline of infinity is none.
    ELSIF NOT isfinite(not_before) THEN
        constraint_name := 'runs_not_before_valid';
        message := 'not_before: must be a finite time (or NULL: as soon as possible)';
    ELSIF NOT isfinite(start_deadline) THEN
        constraint_name := 'runs_start_deadline_valid';
        message := 'start_deadline: must be a finite time (or NULL: none)';
    ELSIF start_deadline <= not_before THEN
        constraint_name := 'runs_start_deadline_valid';
        message := 'start_deadline: must be later than not_before (a run cannot have to start before it may)';
    END IF;
    IF message IS NOT NULL THEN
        RETURN;
    END IF;

    -- Graceful stop (schema 026): how the run is stopped (a cancel, runtime_max_sec) and warned before
    -- runtime_max_sec ends it. A signal is a name from a fixed list (stop_signal_names), never a
    -- number or anything else: it becomes the unit's KillSignal= and a KillUnit call.
    IF unitvisor.signal_short_name(stop_signal) <> ALL (unitvisor.stop_signal_names()) THEN
        constraint_name := 'runs_stop_signal_valid';
        message := 'stop_signal: must be one of ' || array_to_string(unitvisor.stop_signal_names(), ', ')
                   || ' (with or without SIG, any case)';
    -- An hour at most: a stop that takes longer is a run that will not stop.
    ELSIF stop_timeout NOT BETWEEN 1 AND 3600 THEN
        constraint_name := 'runs_stop_timeout_valid';
        message := format('stop_timeout: %s is out of range (1 to 3600 seconds)', stop_timeout);
    -- Its upper bound is runtime_max_sec's (below).
    ELSIF warn_before < 1 THEN
        constraint_name := 'runs_warn_before_valid';
        message := format('warn_before: %s is out of range (at least 1 second, and less than runtime_max_sec)', warn_before);
    ELSIF warn_before IS NOT NULL AND runtime_max_sec IS NULL THEN
        constraint_name := 'runs_warn_before_valid';
        message := 'warn_before: needs runtime_max_sec (the warning is sent that long before runtime_max_sec ends the run)';
    ELSIF warn_before >= runtime_max_sec THEN
        constraint_name := 'runs_warn_before_valid';
        message := format('warn_before: %s is not less than runtime_max_sec (%s): the warning would come before the run starts',
                          warn_before, runtime_max_sec);
    -- KILL is no warning: it would end the run warn_before early.
    ELSIF unitvisor.signal_short_name(warn_signal) <> ALL (unitvisor.stop_signal_names())
          OR unitvisor.signal_short_name(warn_signal) = 'KILL' THEN
        constraint_name := 'runs_warn_signal_valid';
        message := 'warn_signal: must be one of ' || array_to_string(array_remove(unitvisor.stop_signal_names(), 'KILL'), ', ')
                   || ' (with or without SIG, any case)';
    ELSIF warn_signal IS NOT NULL AND warn_before IS NULL THEN
        constraint_name := 'runs_warn_signal_valid';
        message := 'warn_signal: needs warn_before (when to send it)';
    END IF;
END $$;

CREATE OR REPLACE FUNCTION unitvisor.refuse_invalid_arguments() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    problem record;
BEGIN
    problem := unitvisor.run_argument_problem(NEW.argv, NEW.environment, NEW.working_directory, NEW.run_user,
        NEW.memory_max, NEW.memory_high, NEW.cpu_quota_percent, NEW.tasks_max, NEW.io_weight, NEW.runtime_max_sec,
        NEW.max_attempts, NEW.retry_backoff_sec, NEW.retry_backoff_max_sec, NEW.retry_on, NEW.labels,
        NEW.idempotency_key, NEW.concurrency_key, NEW.not_before, NEW.start_deadline, NEW.stop_signal,
        NEW.stop_timeout, NEW.warn_before, NEW.warn_signal);
    IF problem.hint IS NOT NULL THEN
        RAISE EXCEPTION '%', problem.message
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs',
                  CONSTRAINT = problem.constraint_name, HINT = problem.hint;
    ELSIF problem.message IS NOT NULL THEN
        RAISE EXCEPTION '%', problem.message
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs', CONSTRAINT = problem.constraint_name;
    END IF;
    RETURN NEW;
END $$;

DROP TRIGGER runs_arguments_valid ON unitvisor.runs;
CREATE TRIGGER runs_arguments_valid
    BEFORE INSERT OR UPDATE OF argv, environment, working_directory, run_user, memory_max, memory_high,
        cpu_quota_percent, tasks_max, io_weight, runtime_max_sec, max_attempts, retry_backoff_sec,
        retry_backoff_max_sec, retry_on, labels, idempotency_key, concurrency_key, not_before, start_deadline,
        stop_signal, stop_timeout, warn_before, warn_signal
    ON unitvisor.runs
    FOR EACH ROW EXECUTE FUNCTION unitvisor.refuse_invalid_arguments();

-- submit_run with the four arguments at its end. A new signature: the old one is dropped, and the
-- grant given again.
DROP FUNCTION unitvisor.submit_run(text[], jsonb, text, text, bigint, integer, integer, integer, bigint, integer, text, integer, integer, integer, text[], boolean, text, jsonb, text, timestamptz, timestamptz, bigint);

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
    memory_high           bigint  DEFAULT NULL,
    stop_signal           text    DEFAULT NULL,
    stop_timeout          integer DEFAULT NULL,
    warn_before           integer DEFAULT NULL,
    warn_signal           text    DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
-- Bare names in the statements are runs' columns (ON CONFLICT's idempotency_key); the arguments are
-- always written submit_run.<name>.
#variable_conflict use_column
DECLARE
    new_id uuid;
    env jsonb := coalesce(submit_run.environment, '{}'::jsonb);
    run_labels jsonb := coalesce(submit_run.labels, '{}'::jsonb);
    -- Kept short (TERM, not sigterm); a warning's signal is USR1 unless named (Slurm's --signal's).
    run_stop_signal text := unitvisor.signal_short_name(submit_run.stop_signal);
    run_warn_signal text := unitvisor.signal_short_name(
        CASE WHEN submit_run.warn_before IS NULL THEN submit_run.warn_signal
             ELSE coalesce(submit_run.warn_signal, 'USR1') END);
    problem record;
    refused_constraint text;
    refused_state text;
    refused_column text;
BEGIN
    -- Every argument's check, written once (run_argument_problem, which the table's trigger runs_arguments_valid
    -- calls too): the first refused argument, in an error that names it and the constraint it breaks.
    problem := unitvisor.run_argument_problem(submit_run.argv, env, submit_run.working_directory,
        submit_run.run_user, submit_run.memory_max, submit_run.memory_high, submit_run.cpu_quota_percent,
        submit_run.tasks_max, submit_run.io_weight, submit_run.runtime_max_sec, submit_run.max_attempts,
        submit_run.retry_backoff_sec, submit_run.retry_backoff_max_sec, submit_run.retry_on, run_labels,
        submit_run.idempotency_key, submit_run.concurrency_key, submit_run.not_before, submit_run.start_deadline,
        run_stop_signal, submit_run.stop_timeout, submit_run.warn_before, run_warn_signal);
    IF problem.hint IS NOT NULL THEN
        RAISE EXCEPTION '%', problem.message
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs',
                  CONSTRAINT = problem.constraint_name, HINT = problem.hint;
    ELSIF problem.message IS NOT NULL THEN
        RAISE EXCEPTION '%', problem.message
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs', CONSTRAINT = problem.constraint_name;
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
            concurrency_key, not_before, start_deadline, memory_high,
            stop_signal, stop_timeout, warn_before, warn_signal)
        VALUES (submit_run.argv, env, submit_run.working_directory,
            submit_run.run_user, submit_run.memory_max, submit_run.cpu_quota_percent, submit_run.tasks_max,
            submit_run.io_weight, submit_run.runtime_max_sec, submit_run.max_attempts, submit_run.host_pin,
            submit_run.priority, submit_run.retry_backoff_sec, submit_run.retry_backoff_max_sec,
            submit_run.retry_on, coalesce(submit_run.private_network, false), submit_run.idempotency_key,
            run_labels, submit_run.concurrency_key, submit_run.not_before, submit_run.start_deadline,
            submit_run.memory_high,
            run_stop_signal, submit_run.stop_timeout, submit_run.warn_before, run_warn_signal)
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
        GET STACKED DIAGNOSTICS refused_constraint = CONSTRAINT_NAME, refused_state = RETURNED_SQLSTATE,
                                refused_column = COLUMN_NAME;
        -- An explicit NULL for an argument whose column has none (max_attempts, priority, the backoffs, argv):
        -- the column's NOT NULL refused it; the argument is named, as every other refusal names its own.
        IF refused_state = '23502' AND refused_column <> '' THEN
            RAISE EXCEPTION '%: must not be NULL (leave it out for its default)', refused_column
                USING ERRCODE = 'not_null_violation', SCHEMA = 'unitvisor', TABLE = 'runs', COLUMN = refused_column;
        END IF;
        RAISE EXCEPTION 'the run was refused by constraint %', coalesce(nullif(refused_constraint, ''), '(unnamed)')
            USING ERRCODE = refused_state, CONSTRAINT = coalesce(refused_constraint, '');
    END;
    RETURN new_id;
END $$;
REVOKE EXECUTE ON FUNCTION unitvisor.submit_run(text[], jsonb, text, text, bigint, integer, integer, integer, bigint, integer, text, integer, integer, integer, text[], boolean, text, jsonb, text, timestamptz, timestamptz, bigint, text, integer, integer, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.submit_run(text[], jsonb, text, text, bigint, integer, integer, integer, bigint, integer, text, integer, integer, integer, text[], boolean, text, jsonb, text, timestamptz, timestamptz, bigint, text, integer, integer, text) TO unitvisor_submitter;

-- mark_warned: the host's record of a warning it sent.
CREATE FUNCTION unitvisor.mark_warned(run_id uuid, attempt integer, host_id text, host_epoch bigint,
                                      reason text) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM unitvisor.check_fence(mark_warned.host_id, mark_warned.host_epoch);
    UPDATE unitvisor.attempts a SET warned_at = now()
    WHERE a.run_id = mark_warned.run_id AND a.attempt = mark_warned.attempt AND a.host_id = mark_warned.host_id
      AND a.outcome IS NULL AND a.warned_at IS NULL;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    INSERT INTO unitvisor.run_events (run_id, attempt, host_id, state, reason)
    SELECT r.id, mark_warned.attempt, mark_warned.host_id, r.state, mark_warned.reason
    FROM unitvisor.runs r WHERE r.id = mark_warned.run_id;
    RETURN true;
END $$;
REVOKE EXECUTE ON FUNCTION unitvisor.mark_warned(uuid, integer, text, bigint, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.mark_warned(uuid, integer, text, bigint, text) TO unitvisor_host;

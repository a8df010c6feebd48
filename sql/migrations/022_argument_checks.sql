-- unitvisor schema 22 (issue 24): one place for each argument check of submit_run.
--
-- Until now every check of a run's arguments was written twice: once as a CHECK constraint of runs
-- (001, 005, 006, 017: what the table refuses from any writer) and once more as an IF in submit_run
-- (005, then each redefinition of it: 006, 015, 017), to say which argument and why in one clear error,
-- where the constraint's own error shows the whole row. A bound changed in one place and not the other
-- would have let submit_run accept a run the table refuses, or the other way round. Now each check is
-- written once, in unitvisor.run_argument_problem, which returns the first refused argument's message;
-- the table calls it (one trigger, runs_arguments_valid, in place of eighteen constraints), and so does
-- submit_run, whose errors stay as they were: the same SQLSTATE, message and constraint name per
-- argument (docs/sql-api.md). A NULL where the column has none is refused by the column's NOT NULL,
-- which submit_run now reports (as not_null_violation, naming the argument), instead of checking it
-- again itself.
--
-- Expand only, for 0.5.x and 0.6.x daemons and CLIs: submit_run keeps its name, arguments, result and
-- errors (replaced in place, so its grants stay); no daemon writes the checked columns of runs (the
-- trigger does not run on their writes), and what the trigger refuses is exactly what the eighteen
-- constraints refused (run_argument_problem is written from their expressions). Nothing is scanned:
-- dropping a constraint and creating a trigger hold runs' lock for a moment only.

-- submit_run is replaced whole below, from the text 017 gave it, and the constraints of runs dropped
-- below are those 018 left. A migration merged between 018 and this one that changed either would be
-- undone without a word: refuse instead, so that its change is folded into this file first (then
-- update the two digests here: md5 of submit_run's prosrc, and of runs' CHECK constraints as below).
DO $$
BEGIN
    IF (SELECT md5(p.prosrc) FROM pg_catalog.pg_proc p WHERE p.oid = to_regprocedure(
            'unitvisor.submit_run(text[], jsonb, text, text, bigint, integer, integer, integer, bigint, integer, text, '
            'integer, integer, integer, text[], boolean, text, jsonb, text, timestamptz, timestamptz, bigint)'))
            IS DISTINCT FROM 'a34ba2a134c53b3cfbe35018cf719f88' THEN
        RAISE EXCEPTION 'migration 022_argument_checks: unitvisor.submit_run is not as 017_accounting left it'
            USING HINT = 'a migration before 022 changed submit_run: fold its change into 022''s submit_run';
    END IF;
    IF (SELECT md5(string_agg(c.conname || ' ' || pg_catalog.pg_get_constraintdef(c.oid), E'\n' ORDER BY c.conname))
        FROM pg_catalog.pg_constraint c WHERE c.conrelid = 'unitvisor.runs'::regclass AND c.contype = 'c')
            IS DISTINCT FROM '9e0822d8b07e5fbfca48b61743f1662d' THEN
        RAISE EXCEPTION 'migration 022_argument_checks: the CHECK constraints of unitvisor.runs are not as 018 left them'
            USING HINT = 'a migration before 022 changed one: fold its change into run_argument_problem';
    END IF;
END $$;

-- -- the checks ------------------------------------------------------------------------------------

-- The environment's checks, with the message of the first that fails (NULL: none fails). Names may be
-- echoed only once they are valid names (an invalid one may be a "NAME=secret" pasted as a name);
-- values never.
CREATE FUNCTION unitvisor.environment_problem(env jsonb) RETURNS text
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    bad_names bigint;
    bad_name text;
BEGIN
    IF jsonb_typeof(env) <> 'object' THEN
        RETURN format('environment: must be a JSON object of NAME -> string, not a JSON %s', jsonb_typeof(env));
    END IF;
    SELECT count(*) INTO bad_names FROM jsonb_object_keys(env) AS e(name) WHERE e.name !~ '^[A-Za-z_][A-Za-z0-9_]{0,127}$';
    IF bad_names > 0 THEN
        RETURN format('environment: %s name(s) are not valid variable names (letters, digits and _, not starting with a digit, 1 to 128 characters)',
                      bad_names);
    END IF;
    SELECT min(e.name) INTO bad_name FROM jsonb_each(env) AS e(name, value) WHERE jsonb_typeof(e.value) <> 'string';
    IF bad_name IS NOT NULL THEN
        RETURN format('environment: the value of %s is not a string (every value must be a JSON string)', bad_name);
    END IF;
    -- No newline in a value: systemd's Environment= and journald both take it for a record separator.
    -- (jsonb cannot hold NUL at all.)
    SELECT min(e.name) INTO bad_name FROM jsonb_each_text(env) AS e(name, value) WHERE strpos(e.value, E'\n') > 0;
    IF bad_name IS NOT NULL THEN
        RETURN format('environment: the value of %s contains a newline, which systemd and journald take for a record separator',
                      bad_name);
    END IF;
    RETURN NULL;
END $$;

-- 001's test, now the same checks as the message above: one definition of a valid environment.
CREATE OR REPLACE FUNCTION unitvisor.environment_is_valid(env jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT unitvisor.environment_problem(env) IS NULL
$$;

-- Every check of a run's arguments, in submit_run's order: the first that fails, as the constraint it
-- is named by in errors (docs/sql-api.md), its message and a hint; three NULLs when every argument
-- passes. A NULL argument passes (the column's NOT NULL, where there is one, refuses it), as a CHECK
-- constraint lets NULL pass. The table's trigger runs_arguments_valid calls it too, so the two cannot
-- disagree.
-- Sizes (check_run_sizes) are not here: they bound what a host can start, not what a row may hold.
CREATE FUNCTION unitvisor.run_argument_problem(
    argv text[], environment jsonb, working_directory text, run_user text, memory_max bigint,
    memory_high bigint, cpu_quota_percent integer, tasks_max integer, io_weight integer,
    runtime_max_sec bigint, max_attempts integer, retry_backoff_sec integer, retry_backoff_max_sec integer,
    retry_on text[], labels jsonb, idempotency_key text, concurrency_key text, not_before timestamptz,
    start_deadline timestamptz, OUT constraint_name text, OUT message text, OUT hint text)
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
END $$;

-- -- the table -------------------------------------------------------------------------------------
--
-- The eighteen constraints become one trigger that asks run_argument_problem, and raises what submit_run
-- raises: a row written another way (an admin's UPDATE) is refused with the same clear error, naming the
-- argument and its check, where a constraint's error would show the whole row. A trigger on the argument
-- columns, not a CHECK constraint, as 002's runs_argv0_normalised is: a CHECK is evaluated on every
-- update of every row (each claim, start and outcome changes runs), and a new one must be validated by
-- a scan of the whole table; the trigger runs only when an argument is written, and the rows already
-- there passed the eighteen constraints it replaces, which refused exactly what it refuses.
CREATE FUNCTION unitvisor.refuse_invalid_arguments() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    problem record;
BEGIN
    problem := unitvisor.run_argument_problem(NEW.argv, NEW.environment, NEW.working_directory, NEW.run_user,
        NEW.memory_max, NEW.memory_high, NEW.cpu_quota_percent, NEW.tasks_max, NEW.io_weight, NEW.runtime_max_sec,
        NEW.max_attempts, NEW.retry_backoff_sec, NEW.retry_backoff_max_sec, NEW.retry_on, NEW.labels,
        NEW.idempotency_key, NEW.concurrency_key, NEW.not_before, NEW.start_deadline);
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

ALTER TABLE unitvisor.runs
    DROP CONSTRAINT runs_argv_valid,
    DROP CONSTRAINT runs_environment_valid,
    DROP CONSTRAINT runs_working_directory_valid,
    DROP CONSTRAINT runs_run_user_valid,
    DROP CONSTRAINT runs_memory_max_valid,
    DROP CONSTRAINT runs_memory_high_valid,
    DROP CONSTRAINT runs_cpu_quota_valid,
    DROP CONSTRAINT runs_tasks_max_valid,
    DROP CONSTRAINT runs_io_weight_valid,
    DROP CONSTRAINT runs_runtime_max_valid,
    DROP CONSTRAINT runs_max_attempts_valid,
    DROP CONSTRAINT runs_backoff_valid,
    DROP CONSTRAINT runs_retry_on_valid,
    DROP CONSTRAINT runs_labels_valid,
    DROP CONSTRAINT runs_idempotency_key_valid,
    DROP CONSTRAINT runs_concurrency_key_valid,
    DROP CONSTRAINT runs_not_before_valid,
    DROP CONSTRAINT runs_start_deadline_valid;

CREATE TRIGGER runs_arguments_valid
    BEFORE INSERT OR UPDATE OF argv, environment, working_directory, run_user, memory_max, memory_high,
        cpu_quota_percent, tasks_max, io_weight, runtime_max_sec, max_attempts, retry_backoff_sec,
        retry_backoff_max_sec, retry_on, labels, idempotency_key, concurrency_key, not_before, start_deadline
    ON unitvisor.runs
    FOR EACH ROW EXECUTE FUNCTION unitvisor.refuse_invalid_arguments();

-- -- submit_run ------------------------------------------------------------------------------------
--
-- As 017's, with its checks replaced by one call of run_argument_problem, and a NULL where the column has
-- none reported from the column's refusal. Replaced in place (same arguments and result): its grants
-- stay, and every caller of 017's, positional or named, gets the same answers.
CREATE OR REPLACE FUNCTION unitvisor.submit_run(
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
        submit_run.idempotency_key, submit_run.concurrency_key, submit_run.not_before, submit_run.start_deadline);
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

-- unitvisor schema 27 (issue 25, item 3): failure rules.
--
-- retry_on names exit statuses and signals besides outcome kinds (`exit:75`, `signal:TERM`); fail_on
-- names those that end a run at once, whatever retry_on says; an attempt lost with its host (a dead
-- host, a reboot, a fence) no longer uses up max_attempts unless the run says so (count_lost), and
-- max_lost_attempts bounds the lost attempts that do not count, so that a run that kills its hosts
-- ends. Whether a run is tried again is now decided in the database, by failure_verdict, which
-- record_outcome applies to every outcome it records: the daemon's next state (and a peer's, for a
-- dead host's attempt) is a proposal, and the database's decision wins. So one rule holds for every
-- writer: this release's daemons, which propose what failure_verdict decides (its twin in
-- supervisor/outcomes.py), peers, and 0.8.0 daemons, which know none of these rules.
--
-- Expand only, for 0.8.0 daemons and CLIs: three new columns with defaults (the runs already there
-- keep counting lost attempts, as when they were submitted: count_lost is added true, then defaults to
-- false for new runs, with no rewrite of the table); submit_run gains three arguments at the end (DROP
-- and CREATE, its grants again), so every earlier call keeps its meaning; record_outcome keeps its
-- arguments and result (replaced in place). A 0.8.0 daemon that settles a lost attempt of a run with
-- max_attempts 1 proposes `failed`; the database retries the run as its policy says. A peer's proposal
-- of queued or failed for a dead host's lost attempt is no longer refused for disagreeing with the
-- policy: it is decided instead (what the policy is, the database knows best).

ALTER TABLE unitvisor.runs
    ADD COLUMN fail_on text[],
    ADD COLUMN count_lost boolean NOT NULL DEFAULT true,
    ADD COLUMN max_lost_attempts integer NOT NULL DEFAULT 3;
-- The rows above kept true (a constant default is stored once, not written to each row); new runs do not
-- count a lost attempt unless they say so.
ALTER TABLE unitvisor.runs ALTER COLUMN count_lost SET DEFAULT false;

-- -- the checks ------------------------------------------------------------------------------------

CREATE FUNCTION unitvisor.failure_rules_problem(argument text, entries text[]) RETURNS text
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    -- What a run may be retried after: it names the outcomes of unitvisor.attempts.
    retryable CONSTANT text[] := ARRAY['exit-code', 'signal', 'core-dump', 'timeout', 'oom-kill', 'watchdog',
                                       'start-failed', 'lost'];
    -- Python's signal.Signals on Linux without SIG, as supervisor/outcomes.py names a killing signal.
    signals CONSTANT text[] := ARRAY['HUP', 'INT', 'QUIT', 'ILL', 'TRAP', 'ABRT', 'BUS', 'FPE', 'KILL', 'USR1',
        'SEGV', 'USR2', 'PIPE', 'ALRM', 'TERM', 'STKFLT', 'CHLD', 'CONT', 'STOP', 'TSTP', 'TTIN', 'TTOU', 'URG',
        'XCPU', 'XFSZ', 'VTALRM', 'PROF', 'WINCH', 'IO', 'PWR', 'SYS', 'RTMIN', 'RTMAX'];
    allowed text := CASE WHEN argument = 'retry_on'
                         THEN array_to_string(retryable, ', ') || ', exit:N (1 to 255) and signal:NAME (TERM, not SIGTERM)'
                         ELSE 'exit:N (1 to 255) and signal:NAME (TERM, not SIGTERM)' END;
    entry record;
BEGIN
    FOR entry IN SELECT u.e, u.i FROM unnest(entries) WITH ORDINALITY AS u(e, i) LOOP
        IF entry.e IS NULL OR entry.e = '' THEN
            RETURN format('%s: element %s is empty (may hold only %s)', argument, entry.i, allowed);
        ELSIF argument = 'retry_on' AND entry.e = ANY (retryable) THEN
            CONTINUE;
        ELSIF entry.e ~ '^exit:[0-9]+$' THEN
            IF entry.e !~ '^exit:[1-9][0-9]{0,2}$' OR substr(entry.e, 6)::integer > 255 THEN
                RETURN format('%s: %s is no exit status (exit:1 to exit:255; exit:0 is success)', argument,
                              left(entry.e, 64));
            END IF;
        ELSIF entry.e LIKE 'signal:%' THEN
            IF NOT substr(entry.e, 8) = ANY (signals) THEN
                RETURN format('%s: %s names no signal (signal:NAME, the name upper case without SIG: %s)', argument,
                              left(entry.e, 64), array_to_string(signals, ', '));
            END IF;
        ELSE
            RETURN format('%s: %s: may hold only %s', argument, left(entry.e, 64), allowed);
        END IF;
    END LOOP;
    RETURN NULL;
END $$;

CREATE FUNCTION unitvisor.normalised_failure_rules(entries text[]) RETURNS text[]
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE WHEN entries IS NULL THEN NULL ELSE
        coalesce((SELECT array_agg(CASE WHEN u.e ~* '^signal:' THEN 'signal:' || regexp_replace(upper(substr(u.e, 8)), '^SIG', '')
                                        ELSE u.e END ORDER BY u.i)
                  FROM unnest(entries) WITH ORDINALITY AS u(e, i)), '{}'::text[]) END
$$;

DROP FUNCTION unitvisor.run_argument_problem(text[], jsonb, text, text, bigint, bigint, integer, integer, integer,
    bigint, integer, integer, integer, text[], jsonb, text, text, timestamptz, timestamptz, text, integer, integer, text);
CREATE FUNCTION unitvisor.run_argument_problem(
    argv text[], environment jsonb, working_directory text, run_user text, memory_max bigint,
    memory_high bigint, cpu_quota_percent integer, tasks_max integer, io_weight integer,
    runtime_max_sec bigint, max_attempts integer, retry_backoff_sec integer, retry_backoff_max_sec integer,
    retry_on text[], labels jsonb, idempotency_key text, concurrency_key text, not_before timestamptz,
    start_deadline timestamptz, stop_signal text, stop_timeout integer, warn_before integer,
    warn_signal text, fail_on text[], count_lost boolean, max_lost_attempts integer,
    OUT constraint_name text, OUT message text, OUT hint text)
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
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
    -- Outcomes, and since 027 exit statuses and signals (failure_rules_problem, with fail_on's).
    ELSIF unitvisor.failure_rules_problem('retry_on', retry_on) IS NOT NULL THEN
        constraint_name := 'runs_retry_on_valid';
        message := unitvisor.failure_rules_problem('retry_on', retry_on);

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
    IF message IS NOT NULL THEN
        RETURN;
    END IF;
    -- Failure rules (027): fail_on names exit statuses and signals only (an outcome kind that must not
    -- be retried is one retry_on leaves out), and no code may be in both lists: which of the two wins
    -- would be a rule to remember, and either answer surprises whoever wrote the other list.
    -- count_lost needs no check (the column's NOT NULL refuses a NULL).
    IF cardinality(fail_on) > 64 THEN
        constraint_name := 'runs_fail_on_valid';
        message := format('fail_on: %s elements, over the limit of 64', cardinality(fail_on));
    ELSIF unitvisor.failure_rules_problem('fail_on', fail_on) IS NOT NULL THEN
        constraint_name := 'runs_fail_on_valid';
        message := unitvisor.failure_rules_problem('fail_on', fail_on);
    ELSIF fail_on && retry_on THEN
        constraint_name := 'runs_fail_on_valid';
        message := format('fail_on: %s is in retry_on too (a code either ends the run at once or retries it)',
                          (SELECT f FROM unnest(fail_on) f WHERE f = ANY (retry_on) LIMIT 1));
    ELSIF max_lost_attempts NOT BETWEEN 1 AND 1000 THEN
        constraint_name := 'runs_max_lost_attempts_valid';
        message := format('max_lost_attempts: %s is out of range (1 to 1000)', max_lost_attempts);
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
        NEW.stop_timeout, NEW.warn_before, NEW.warn_signal, NEW.fail_on, NEW.count_lost, NEW.max_lost_attempts);
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
        stop_signal, stop_timeout, warn_before, warn_signal, fail_on, count_lost, max_lost_attempts
    ON unitvisor.runs
    FOR EACH ROW EXECUTE FUNCTION unitvisor.refuse_invalid_arguments();

CREATE OR REPLACE FUNCTION unitvisor.check_run_sizes(argv text[], environment jsonb, working_directory text, host_pin text,
    retry_on text[]) RETURNS void
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    string_max CONSTANT integer := 131071;
    total_max CONSTANT integer := 524288;
    names_max CONSTANT integer := 256;
    pointer CONSTANT integer := 8;
    bad record;
    total bigint;
BEGIN
    SELECT a.i, octet_length(a.element) AS size INTO bad
    FROM unnest(check_run_sizes.argv) WITH ORDINALITY AS a(element, i)
    WHERE octet_length(a.element) > string_max ORDER BY a.i LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'argv: element % is % bytes, over the limit of % (the kernel''s MAX_ARG_STRLEN, 128 KiB with its NUL)',
            bad.i, bad.size, string_max USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT sum(octet_length(a.element) + 1 + pointer) INTO total FROM unnest(check_run_sizes.argv) AS a(element);
    IF total > total_max THEN
        RAISE EXCEPTION 'argv: % bytes in all, over the limit of % (each element''s bytes, its NUL and an 8-byte pointer, as execve counts them)',
            total, total_max USING ERRCODE = 'invalid_parameter_value';
    END IF;

    IF jsonb_typeof(check_run_sizes.environment) = 'object' THEN
        IF (SELECT count(*) FROM jsonb_object_keys(check_run_sizes.environment)) > names_max THEN
            RAISE EXCEPTION 'environment: % names, over the limit of %',
                (SELECT count(*) FROM jsonb_object_keys(check_run_sizes.environment)), names_max
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        -- Only a valid name is echoed (an invalid one may be a "NAME=secret" pasted as a name).
        SELECT CASE WHEN e.name ~ '^[A-Za-z_][A-Za-z0-9_]{0,127}$' THEN e.name ELSE '(an invalid name)' END AS name,
               octet_length(e.name) + 1 + octet_length(e.value) AS size INTO bad
        FROM jsonb_each_text(check_run_sizes.environment) AS e(name, value)
        WHERE octet_length(e.name) + 1 + octet_length(e.value) > string_max ORDER BY e.name LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION 'environment: %=value is % bytes, over the limit of % (the kernel''s MAX_ARG_STRLEN, 128 KiB with its NUL)',
                bad.name, bad.size, string_max USING ERRCODE = 'invalid_parameter_value';
        END IF;
        SELECT sum(octet_length(e.name) + 1 + octet_length(e.value) + 1 + pointer) INTO total
        FROM jsonb_each_text(check_run_sizes.environment) AS e(name, value);
        IF total > total_max THEN
            RAISE EXCEPTION 'environment: % bytes in all, over the limit of % (each NAME=value''s bytes, its NUL and an 8-byte pointer, as execve counts them)',
                total, total_max USING ERRCODE = 'invalid_parameter_value';
        END IF;
    END IF;

    IF octet_length(check_run_sizes.working_directory) > 4095 THEN
        RAISE EXCEPTION 'working_directory: % bytes, over the limit of 4095 (PATH_MAX, 4096 with its NUL)',
            octet_length(check_run_sizes.working_directory) USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF length(check_run_sizes.host_pin) > 255 THEN
        RAISE EXCEPTION 'host_pin: % characters, over the limit of 255 (a host id is at most 255)',
            length(check_run_sizes.host_pin) USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF cardinality(check_run_sizes.retry_on) > 64 THEN
        RAISE EXCEPTION 'retry_on: % elements, over the limit of 64',
            cardinality(check_run_sizes.retry_on) USING ERRCODE = 'invalid_parameter_value';
    END IF;
END $$;

-- -- submit_run: fail_on, count_lost, max_lost_attempts ------------------------------------------
--
-- As 026's, with the three last and defaulted, and retry_on's and fail_on's signal names normalised.
-- DROP and CREATE (the signature changes), then the grants again, as 017 did.
DROP FUNCTION unitvisor.submit_run(text[], jsonb, text, text, bigint, integer, integer, integer, bigint,
    integer, text, integer, integer, integer, text[], boolean, text, jsonb, text, timestamptz, timestamptz, bigint,
    text, integer, integer, text);
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
    warn_signal           text    DEFAULT NULL,
    -- Failure rules (027).
    fail_on               text[]  DEFAULT NULL,
    count_lost            boolean DEFAULT false,
    max_lost_attempts     integer DEFAULT 3
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
    -- Failure rules (027): signal names in one spelling, as attempts record them.
    retry_rules text[] := unitvisor.normalised_failure_rules(submit_run.retry_on);
    fail_rules text[] := unitvisor.normalised_failure_rules(submit_run.fail_on);
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
        submit_run.retry_backoff_sec, submit_run.retry_backoff_max_sec, retry_rules, run_labels,
        submit_run.idempotency_key, submit_run.concurrency_key, submit_run.not_before, submit_run.start_deadline,
        run_stop_signal, submit_run.stop_timeout, submit_run.warn_before, run_warn_signal,
        fail_rules, submit_run.count_lost, submit_run.max_lost_attempts);
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
                                      retry_rules);

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
            stop_signal, stop_timeout, warn_before, warn_signal, fail_on, count_lost, max_lost_attempts)
        VALUES (submit_run.argv, env, submit_run.working_directory,
            submit_run.run_user, submit_run.memory_max, submit_run.cpu_quota_percent, submit_run.tasks_max,
            submit_run.io_weight, submit_run.runtime_max_sec, submit_run.max_attempts, submit_run.host_pin,
            submit_run.priority, submit_run.retry_backoff_sec, submit_run.retry_backoff_max_sec,
            retry_rules, coalesce(submit_run.private_network, false), submit_run.idempotency_key,
            run_labels, submit_run.concurrency_key, submit_run.not_before, submit_run.start_deadline,
            submit_run.memory_high,
            run_stop_signal, submit_run.stop_timeout, submit_run.warn_before, run_warn_signal,
            fail_rules, submit_run.count_lost, submit_run.max_lost_attempts)
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
REVOKE EXECUTE ON FUNCTION unitvisor.submit_run(text[], jsonb, text, text, bigint, integer, integer, integer,
    bigint, integer, text, integer, integer, integer, text[], boolean, text, jsonb, text, timestamptz, timestamptz,
    bigint, text, integer, integer, text, text[], boolean, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.submit_run(text[], jsonb, text, text, bigint, integer, integer, integer,
    bigint, integer, text, integer, integer, integer, text[], boolean, text, jsonb, text, timestamptz, timestamptz,
    bigint, text, integer, integer, text, text[], boolean, integer) TO unitvisor_submitter;

-- -- the decision ----------------------------------------------------------------------------------

CREATE FUNCTION unitvisor.failure_verdict(
    max_attempts integer, retry_on text[], fail_on text[], count_lost boolean, max_lost_attempts integer,
    cancel_requested boolean, attempt integer, lost integer, outcome text, exit_status text,
    OUT retry boolean, OUT why text)
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    failures CONSTANT text[] := ARRAY['exit-code', 'signal', 'core-dump', 'timeout', 'oom-kill', 'watchdog',
                                      'start-failed', 'lost'];
    -- The entry an exit status matches: exit:N only the main process's own exit (exit-code), signal:NAME
    -- only a kill by that signal (signal, core-dump); a timeout's or an OOM kill's signal is named by
    -- its outcome instead, so that signal:TERM does not also retry every runtime_max.
    code text := CASE WHEN outcome = 'exit-code' AND exit_status LIKE 'exit:%' THEN exit_status
                      WHEN outcome IN ('signal', 'core-dump') AND exit_status LIKE 'signal:%' THEN exit_status END;
    uncounted integer := CASE WHEN count_lost THEN 0 ELSE lost END;
BEGIN
    retry := false;
    IF cancel_requested OR NOT outcome = ANY (failures) THEN
        RETURN;
    ELSIF code = ANY (fail_on) THEN
        why := format('no retry: fail_on names %s', code);
    ELSIF NOT (retry_on IS NULL OR outcome = ANY (retry_on) OR coalesce(code = ANY (retry_on), false)) THEN
        RETURN;
    ELSIF outcome = 'lost' AND NOT count_lost THEN
        IF lost >= max_lost_attempts THEN
            why := format('no retry: max_lost_attempts reached (%s attempts lost with their host)', lost);
        ELSE
            retry := true;
            why := format('lost with its host, not counted against max_attempts (%s of max_lost_attempts %s)',
                          lost, max_lost_attempts);
        END IF;
    ELSE
        retry := attempt - uncounted < max_attempts;
    END IF;
END $$;
REVOKE EXECUTE ON FUNCTION unitvisor.failure_verdict(integer, text[], text[], boolean, integer, boolean, integer,
    integer, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.failure_verdict(integer, text[], text[], boolean, integer, boolean, integer,
    integer, text, text) TO unitvisor_submitter, unitvisor_host;

-- As 017's, with the run's next state decided by failure_verdict. Replaced in place: its grants stay,
-- and the shorter forms reach it.
CREATE OR REPLACE FUNCTION unitvisor.record_outcome(
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
    verdict record;
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
        -- Whether the run goes on or ends is the run's policy's (failure_verdict, below), not the peer's:
        -- a peer proposes queued or failed, and the database decides.
        IF record_outcome.exit_status IS NOT NULL
                OR NOT ((record_outcome.outcome = 'lost'
                         AND (state_after IN ('queued', 'failed')
                              OR (run.cancel_requested_at IS NOT NULL AND state_after = 'cancelled')))
                        OR (record_outcome.outcome = 'cancelled' AND state_after = 'cancelled'
                            AND run.cancel_requested_at IS NOT NULL)) THEN
            RAISE EXCEPTION 'host % may not settle attempt % of run % of dead host % as % (%) moving the run to %: a peer records only lost, with no exit status, the run moved on by its own policy (queued or failed, as the database decides), or cancelled when a cancel was requested',
                record_outcome.host_id, record_outcome.attempt, record_outcome.run_id, target.host_id,
                record_outcome.outcome, coalesce(record_outcome.exit_status, 'no exit status'), state_after
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
    -- Failure rules (027): whether the run is tried again is decided here, by its own policy, whatever
    -- the writer proposed (failure_verdict says why). A retry the writer did not propose waits the
    -- run's backoff, as supervisor/outcomes.py retry_delay computes it.
    IF state_after IN ('queued', 'failed') THEN
        SELECT * INTO run FROM unitvisor.runs r WHERE r.id = record_outcome.run_id FOR UPDATE;
        verdict := unitvisor.failure_verdict(run.max_attempts, run.retry_on, run.fail_on, run.count_lost,
            run.max_lost_attempts, run.cancel_requested_at IS NOT NULL, record_outcome.attempt,
            (SELECT count(*)::integer FROM unitvisor.attempts a WHERE a.run_id = record_outcome.run_id AND a.outcome = 'lost'),
            record_outcome.outcome, record_outcome.exit_status);
        IF verdict.retry THEN
            state_after := 'queued';
            delay := coalesce(delay, make_interval(secs => least(run.retry_backoff_sec * 2 ^ least(record_outcome.attempt - 1, 32),
                                                                 run.retry_backoff_max_sec) * (0.5 + random() / 2)));
        ELSE
            state_after := 'failed';
            delay := NULL;
        END IF;
        IF verdict.why IS NOT NULL THEN
            detail := detail || '; ' || verdict.why;
        END IF;
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

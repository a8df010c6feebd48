-- unitvisor: the whole current schema, in one file, for reading.
--
-- This is the file to open to learn what the database holds: every table, index, function, trigger,
-- policy and grant as they are now, grouped by concern, each function in its final definition. The
-- numbered files in sql/migrations/ are the history: how a database of each earlier release became
-- this one, each change written so that the release before it keeps working meanwhile (the rules
-- are in supervisor/store.py, above migration_files). A function's comment may still say what it
-- changed ("as in 006, ..."): the migration named there tells why it changed.
--
-- Kept equal to the migrations by tests/integration/test_schema_file.py, which builds one database
-- by every migration and one from this file and compares their catalogs; its failure message names
-- what differs. Adding a migration: write sql/migrations/NNN_name.sql, then make the same change here
-- (replace the function's text by the new one, add the column at the end of its table, ...) and add
-- the migration's name to the list at the end of this file (README, "The schema").
--
-- `unitvisor migrate` applies this file to an empty database, in one transaction, and records the
-- migrations listed at its end as applied; a later migration then applies on top as on any other
-- database. By hand: psql -1 -v ON_ERROR_STOP=1 -f sql/schema.sql, as a role that may create roles.
--
-- Order: roles and the schema; the closed vocabularies (functions the CHECK constraints call); the
-- tables with their indexes; the functions, by who calls them; triggers; row-level security; grants.

-- Function bodies call functions defined further down (the file is ordered by concern, not by call
-- graph); bodies are checked when first called instead, as pg_dump does.
SET LOCAL check_function_bodies = false;

-- == roles and the schema ===========================================================================
--
-- * unitvisor_admin     owns the schema and every object in it; runs migrations, drains and forgets
--                       hosts, binds host roles (`unitvisor hosts add`), and may act as any host.
-- * unitvisor_submitter for control planes: submits, cancels, resumes and reads runs, through
--                       functions only; writes no table directly.
-- * unitvisor_host      every host's own login role is a member, and is bound to one host id in
--                       unitvisor.host_roles. It writes nothing directly either: every write is a
--                       SECURITY DEFINER function that checks, against session_user, that the caller
--                       is the host it writes for. It reads runs unpinned or pinned to itself (an
--                       environment may hold what other hosts must not see), not the others.
-- * unitvisor_river     (034) the River source's functions, which create runs: granted by the admin to
--                       the login roles of the hosts that serve a River source, besides unitvisor_host.

-- Roles are the cluster's, not the database's: another database of the same cluster may be migrating
-- at this very moment. Whichever commits second gets duplicate_object (or unique_violation on
-- pg_authid's index when both were inside CREATE ROLE at once), which only means the role exists.
DO $$
DECLARE
    role_name text;
BEGIN
    FOREACH role_name IN ARRAY ARRAY['unitvisor_admin', 'unitvisor_submitter', 'unitvisor_host', 'unitvisor_river'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles r WHERE r.rolname = role_name) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I NOLOGIN', role_name);
            EXCEPTION WHEN duplicate_object OR unique_violation THEN
                NULL;  -- created meanwhile by a migrate in another database
            END;
        END IF;
    END LOOP;
END $$;

-- The schema and the migrations' bookkeeping, as `unitvisor migrate` creates them before anything else.
CREATE SCHEMA IF NOT EXISTS unitvisor;
CREATE TABLE IF NOT EXISTS unitvisor.schema_migrations (
    version text PRIMARY KEY,
    applied_at timestamptz NOT NULL DEFAULT now());

-- Who may administer: the role creating the schema now, the schema's owner and the database's owner
-- (who may drop the whole database anyway; README's Install makes it the admin's login role).
-- Superusers are members of everything already.
DO $$
DECLARE
    who text;
BEGIN
    FOR who IN
        SELECT DISTINCT r.rolname FROM pg_catalog.pg_roles r
        WHERE r.oid IN (
            (SELECT r2.oid FROM pg_catalog.pg_roles r2 WHERE r2.rolname = current_user),
            (SELECT n.nspowner FROM pg_catalog.pg_namespace n WHERE n.nspname = 'unitvisor'),
            (SELECT d.datdba FROM pg_catalog.pg_database d WHERE d.datname = current_database()))
          AND NOT r.rolsuper AND r.rolname <> 'unitvisor_admin'
          AND NOT pg_catalog.pg_has_role(r.oid, 'unitvisor_admin', 'MEMBER')
    LOOP
        BEGIN
            EXECUTE format('GRANT unitvisor_admin TO %I', who);
        EXCEPTION WHEN unique_violation THEN
            NULL;  -- granted meanwhile by a migrate in another database
        END;
    END LOOP;
END $$;

ALTER SCHEMA unitvisor OWNER TO unitvisor_admin;
ALTER TABLE unitvisor.schema_migrations OWNER TO unitvisor_admin;
-- Everything below is the admin's, not the login role's that happens to create it (the migrations after
-- 004 run so too); SET LOCAL ends with the transaction.
SET LOCAL ROLE unitvisor_admin;

-- Functions are executable by PUBLIC unless revoked: not any function the admin creates (grants, at the
-- end, then open each to the roles that call it).
ALTER DEFAULT PRIVILEGES FOR ROLE unitvisor_admin REVOKE EXECUTE ON FUNCTIONS FROM PUBLIC;

-- == the checks of a run's arguments ==============================================================
--
-- Each check of what a run may hold is written once, in run_argument_problem: the table's one constraint
-- on the arguments (runs_arguments_valid) calls it, and so does submit_run, to say which argument it
-- refuses and why. The closed vocabularies are CHECKs rather than enum types: adding a value later is
-- a function replaced in a migration, where an enum would need ALTER TYPE outside a transaction. The
-- functions here come before the tables, whose constraints call them.

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
CREATE FUNCTION unitvisor.environment_is_valid(env jsonb) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT unitvisor.environment_problem(env) IS NULL
$$;

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

-- Failure rules (027): what retry_on and fail_on may hold, as the message of the first entry refused
-- (NULL: every entry passes). retry_on names outcomes (those worth a retry) and, as fail_on does, exit
-- statuses of the main process, `exit:1` to `exit:255` (`exit:0` is success), and signals that killed
-- it, `signal:NAME` with the name as attempts' exit_status records it: `signal:TERM`, upper case and
-- without SIG (submit_run writes `signal:SIGTERM` and `signal:term` so, normalised_failure_rules). Only
-- the signals Linux names: a number or a misspelt name would never match and a retry would silently
-- not happen. An empty or NULL entry is refused (it matches nothing either).
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

-- retry_on's and fail_on's entries as the table keeps them: `signal:SIGTERM` and `signal:term` become
-- `signal:TERM` (how attempts record a signal); anything else is left as it is, for the check to judge.
CREATE FUNCTION unitvisor.normalised_failure_rules(entries text[]) RETURNS text[]
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE WHEN entries IS NULL THEN NULL ELSE
        coalesce((SELECT array_agg(CASE WHEN u.e ~* '^signal:' THEN 'signal:' || regexp_replace(upper(substr(u.e, 8)), '^SIG', '')
                                        ELSE u.e END ORDER BY u.i)
                  FROM unnest(entries) WITH ORDINALITY AS u(e, i)), '{}'::text[]) END
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
    start_deadline timestamptz, stop_signal text, stop_timeout integer, warn_before integer,
    warn_signal text, fail_on text[], count_lost boolean, max_lost_attempts integer,
    -- 032; defaulted (NULL passes), so that a submit_run of another migration that passes the 26
    -- arguments before it still finds this function (the column's trigger checks the row all the same).
    concurrency_limit integer DEFAULT NULL,
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
    IF message IS NOT NULL THEN
        RETURN;
    END IF;
    -- Concurrency limits (032): how many runs of its concurrency_key may be live at once, this one among
    -- them. More than one needs a key: without one, there is nothing to count the others by.
    IF concurrency_limit NOT BETWEEN 1 AND 10000 THEN
        constraint_name := 'runs_concurrency_limit_valid';
        message := format('concurrency_limit: %s is out of range (1 to 10000)', concurrency_limit);
    ELSIF concurrency_limit > 1 AND concurrency_key IS NULL THEN
        constraint_name := 'runs_concurrency_limit_valid';
        message := 'concurrency_limit: needs concurrency_key (the limit counts the live runs of one key)';
    END IF;
END $$;

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
        NEW.idempotency_key, NEW.concurrency_key, NEW.not_before, NEW.start_deadline, NEW.stop_signal,
        NEW.stop_timeout, NEW.warn_before, NEW.warn_signal, NEW.fail_on, NEW.count_lost, NEW.max_lost_attempts,
        NEW.concurrency_limit);
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

-- The check of placement's arguments, beside run_argument_problem (which it does not change): the first
-- refused, as the constraint it is named by and its message; two NULLs when they pass. avoid_failed_host
-- is any boolean, or NULL.
CREATE FUNCTION unitvisor.placement_problem(host_labels jsonb, OUT constraint_name text, OUT message text)
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF host_labels IS NULL OR NOT unitvisor.labels_are_valid(host_labels) THEN
        constraint_name := 'runs_host_labels_valid';
        message := 'host_labels: must be a JSON object of at most 64 key -> string pairs, each as a label (a key of 1 to 63 letters, digits, ".", "_", "-" and "/", starting and ending with a letter or digit; a value of at most 255 characters, without control characters)';
    END IF;
END $$;

-- placement_problem for a row written another way (an admin's UPDATE), as refuse_invalid_arguments.
CREATE FUNCTION unitvisor.refuse_invalid_placement() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    problem record;
BEGIN
    problem := unitvisor.placement_problem(NEW.host_labels);
    IF problem.message IS NOT NULL THEN
        RAISE EXCEPTION '%', problem.message
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs', CONSTRAINT = problem.constraint_name;
    END IF;
    RETURN NEW;
END $$;

-- == tables =========================================================================================
--
-- Everything lives in the schema "unitvisor", so that it can share a database with the control plane
-- that submits runs. Columns are in the order the migrations added them (a table's row type, and so a
-- function taking `unitvisor.runs`, depends on it): the later ones are at the end of each table.
-- Daemons read rows by explicit column lists, never SELECT *: a column added later, or by a control
-- plane, is invisible to them.

-- -- runs ----------------------------------------------------------------------------------------------

-- One row per submitted run: what to run, with which limits, and where it stands.
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
    -- No network at all: its unit gets PrivateNetwork=yes (loopback only). Every host can do that, so
    -- it is no reason to refuse a run.
    private_network     boolean NOT NULL DEFAULT false,
    labels              jsonb NOT NULL DEFAULT '{}'::jsonb,
    -- The caller's name for one submit, so that a retried submit (a timeout, a crash between COMMIT
    -- and hearing of it) finds the run it made instead of making another. Unique among all runs of
    -- the database, for as long as the run exists: a control plane sharing the database prefixes its keys.
    idempotency_key     text,
    -- Runs that share a key never run at the same time anywhere in the fleet, beyond their
    -- concurrency_limit (032; 1 by default); the later ones wait, in submission order.
    concurrency_key     text,
    -- The run's first start is not before this time.
    not_before          timestamptz,
    -- A run that has not started by then ends as `expired`.
    start_deadline      timestamptz,
    -- Submission order (run_seq, below): the runs of one transaction in the order submit_run was called.
    -- NULL for runs that were finished when 013 added it, and those come before every number.
    seq                 bigint,
    -- systemd's MemoryHigh=: over it the kernel reclaims and throttles, never kills (memory_max does).
    memory_high         bigint,
    -- Graceful stop (schema 026): the unit's KillSignal= (NULL: TERM) and TimeoutStopSec= in seconds
    -- (NULL: the host's [systemd] stop_grace), then SIGKILL; warn_signal sent warn_before seconds before
    -- runtime_max_sec ends the run (by the daemon: docs/sql-api.md, "Graceful stop").
    stop_signal         text,
    stop_timeout        integer,
    warn_before         integer,
    warn_signal         text,
    -- Failure rules (027): exit statuses and signals that end the run at once, whatever retry_on says;
    -- whether an attempt lost with its host counts against max_attempts (the runs already there when
    -- 027 was applied count it, as they did when they were submitted); how many lost attempts a run
    -- may have when they do not count, so that a run that kills its hosts ends.
    fail_on             text[],
    count_lost          boolean NOT NULL DEFAULT false,
    max_lost_attempts   integer NOT NULL DEFAULT 3,
    -- While held (030; queued only): since when, and by which login role. NULL: not held. A held run
    -- has no spawn job, so no claim looks at it (hold_run).
    held_at             timestamptz,
    held_by             text,
    -- How many runs of its concurrency_key may be live at once, this one among them (032; 1: one at a
    -- time). Runs of one key with different limits: concurrency_blocker says which applies.
    concurrency_limit   integer NOT NULL DEFAULT 1,
    -- Placement (033): labels every host that runs it must have ('{}': any host), and whether a retry
    -- prefers another host than its last attempt's (NULL: after a lost attempt only; avoids_host).
    host_labels         jsonb NOT NULL DEFAULT '{}'::jsonb,
    avoid_failed_host   boolean,
    -- The River job this run was made from (034; NULL: submitted otherwise). River's ids are bigserial.
    river_job_id        bigint CONSTRAINT runs_river_job_id_valid CHECK (river_job_id > 0),
    -- What the run needs of the runs it runs after (035; run_dependencies): 'succeeded' or 'finished'
    -- (NULL: it names none); when they had all ended as it needs and it was released (NULL while it
    -- waits for them; a resume clears it). A waiting run has no spawn job (settle_dependencies).
    -- after_policy's check is check_after's (the error names runs_after_policy_valid).
    after_policy        text,
    after_met_at        timestamptz,

    -- Every argument of submit_run is checked by the trigger runs_arguments_valid (below): the bounds,
    -- the forms and why each is refused are in run_argument_problem (above), and only there.
    CONSTRAINT runs_state_valid CHECK (state IN
        ('queued', 'starting', 'running', 'succeeded', 'failed', 'cancelled', 'expired', 'skipped'))
);

CREATE INDEX runs_state_idx ON unitvisor.runs (state) WHERE state IN ('queued', 'starting', 'running');
CREATE INDEX runs_created_idx ON unitvisor.runs (created_at);
-- The arbiter of concurrent submits with one key (INSERT ... ON CONFLICT in submit_run).
CREATE UNIQUE INDEX runs_idempotency_key_idx ON unitvisor.runs (idempotency_key) WHERE idempotency_key IS NOT NULL;
-- runs_with_labels' containment (@>): jsonb_path_ops is smaller and faster for @>, the only operator used.
CREATE INDEX runs_labels_idx ON unitvisor.runs USING gin (labels jsonb_path_ops);
-- The live runs of a key with their limits (concurrency_blocker): since 032 a key may have several.
CREATE INDEX runs_live_key_idx ON unitvisor.runs (concurrency_key, concurrency_limit)
    WHERE state IN ('starting', 'running') AND concurrency_key IS NOT NULL;
-- The last line of defence of "one live run per key" for the runs that ask for it (concurrency_limit
-- 1, the default): whatever the claim's lock and checks miss, such a run never shares its key while
-- it is live. (A key's runs with larger limits are held to them by the claim alone, under the key's lock.)
CREATE UNIQUE INDEX runs_one_live_per_key_idx ON unitvisor.runs (concurrency_key)
    WHERE state IN ('starting', 'running') AND concurrency_key IS NOT NULL AND concurrency_limit = 1;
-- A named limit's count of its live runs (claim_limits, limit_status): containment among live runs
-- only, so that a count reads the live runs that match, never the history.
CREATE INDEX runs_live_labels_idx ON unitvisor.runs USING gin (labels jsonb_path_ops)
    WHERE state IN ('starting', 'running');
-- The claim's look-up of an earlier queued run of the same key (runs numbered NULL): a backward range
-- scan that stops at the first row.
CREATE INDEX runs_queued_key_idx ON unitvisor.runs (concurrency_key, created_at, id)
    WHERE state = 'queued' AND concurrency_key IS NOT NULL;
-- expire_runs' scan: queued runs with a deadline, by deadline. Empty when nobody uses deadlines, so a
-- pass with nothing to do is one index probe.
CREATE INDEX runs_start_deadline_idx ON unitvisor.runs (start_deadline)
    WHERE state = 'queued' AND start_deadline IS NOT NULL;
-- Retention: old finished runs, oldest first, without reading a live run's entry (live runs have no
-- finished_at). README's Upgrade names it: an operator may build it CONCURRENTLY beforehand.
CREATE INDEX runs_finished_idx ON unitvisor.runs (finished_at) WHERE finished_at IS NOT NULL;
-- One run per River job (034): a second claim of the same job cannot make a second run.
CREATE UNIQUE INDEX runs_river_job_id_once ON unitvisor.runs (river_job_id) WHERE river_job_id IS NOT NULL;

-- Every run submitted takes the next number at its INSERT (runs.seq).
CREATE SEQUENCE unitvisor.run_seq AS bigint;
ALTER SEQUENCE unitvisor.run_seq OWNED BY unitvisor.runs.seq;
ALTER TABLE unitvisor.runs ALTER COLUMN seq SET DEFAULT nextval('unitvisor.run_seq');
-- concurrency_blocker's look-up of the queued run of the same key submitted just before: a backward
-- range scan that stops at the first row.
CREATE INDEX runs_queued_key_seq_idx ON unitvisor.runs (concurrency_key, seq)
    WHERE state = 'queued' AND concurrency_key IS NOT NULL;
-- A key's queued runs numbered NULL (submitted before 013, or resumed since): concurrency_blocker's
-- third look-up. Without it, the look-up for a numbered run walked every queued run of the key
-- (runs_queued_key_idx has no seq) to find none: 10,000 rows for each run behind a key of 10,000.
CREATE INDEX runs_queued_key_unnumbered_idx ON unitvisor.runs (concurrency_key, created_at, id)
    WHERE state = 'queued' AND concurrency_key IS NOT NULL AND seq IS NULL;

-- -- run_dependencies ----------------------------------------------------------------------------------

-- One row per run a run runs after (submit_run's after). Both ends are runs; a row goes with either
-- (retention keeps a run that a live run names: needed_by_live_run).
CREATE TABLE unitvisor.run_dependencies (
    run_id   uuid NOT NULL REFERENCES unitvisor.runs (id) ON DELETE CASCADE,
    after_id uuid NOT NULL REFERENCES unitvisor.runs (id) ON DELETE CASCADE,
    PRIMARY KEY (run_id, after_id)
);
-- The runs that name one: runs_settle_dependants' look-up when a run ends, and `runs --after`.
CREATE INDEX run_dependencies_after_idx ON unitvisor.run_dependencies (after_id);

-- Skips not yet counted in a daemon's unitvisor_runs_skipped_total: one row per skip, inserted by
-- settle_dependencies (only inserted, so sessions that skip runs never wait for each other), and
-- deleted by the daemon that counts it (count_skips): each skip is counted once in the fleet.
CREATE TABLE unitvisor.uncounted_skips (
    run_id     uuid NOT NULL,
    skipped_at timestamptz NOT NULL DEFAULT now()
);

-- -- attempts ------------------------------------------------------------------------------------------

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
    -- What systemd measured of the attempt's unit. NULL means "not measured": systemd does not have
    -- the figure for this unit on this host (its version, the cgroup layout or a controller it may
    -- not use), or the outcome was recorded without the unit (a host reboot, a dead host's attempts
    -- taken over, an older daemon). Bytes and nanoseconds as systemd reports them.
    cpu_usage_nsec    bigint,
    memory_peak_bytes bigint,
    io_read_bytes     bigint,
    io_write_bytes    bigint,
    -- The last lines of the attempt's output, cut by its host's [runs] output_tail_lines and
    -- output_tail_bytes; NULL when it kept none. The full output stays in journald. Written once,
    -- after the outcome (record_output_tails), never replaced.
    output_tail   text,
    -- The most tasks the unit had at once: the kernel's pids.peak of its cgroup, copied by the unit's
    -- own ExecStopPost= before systemd removes the cgroup (supervisor/taskspeak.py). NULL: not measured.
    tasks_peak    bigint,
    -- When its host sent the run's warn_signal (schema 026): once per attempt, also across a daemon's
    -- restart. NULL: not sent (none asked for, or not yet).
    warned_at     timestamptz,
    -- The operator's last freeze request on this attempt's unit (030): 'frozen' or 'thawed', when, by whom;
    -- what the host last did: the unit's freezer state after it, why it refused (NULL: done), when, and
    -- which request it answered (its freeze_requested_at): pending while the two differ (freeze_pending).
    freeze_wanted       text,
    freeze_requested_at timestamptz,
    freeze_requested_by text,
    freeze_state        text,
    freeze_refused      text,
    freeze_acted_at     timestamptz,
    freeze_acted_on     timestamptz,
    PRIMARY KEY (run_id, attempt),
    CONSTRAINT attempts_outcome_valid CHECK (outcome IS NULL OR outcome IN (
        'success', 'exit-code', 'signal', 'core-dump', 'timeout', 'oom-kill', 'watchdog',
        'start-failed', 'lost', 'cancelled', 'refused')),
    CONSTRAINT attempts_exit_status_valid CHECK (exit_status IS NULL OR exit_status ~ '^(exit:[0-9]+|signal:[A-Z0-9+-]+)$'),
    CONSTRAINT attempts_ended_has_outcome CHECK ((outcome IS NULL) = (ended_at IS NULL)),
    -- record_outcome's error names it.
    CONSTRAINT attempts_accounting_valid CHECK (
        cpu_usage_nsec >= 0 AND memory_peak_bytes >= 0 AND io_read_bytes >= 0 AND io_write_bytes >= 0
        AND tasks_peak >= 0),
    -- The bound of the config key (64 KiB), so that a row stays small whatever a host is configured with.
    CONSTRAINT attempts_output_tail_valid CHECK (octet_length(output_tail) <= 65536)
);

-- The daemon's working set: this host's attempts that have no outcome yet.
CREATE INDEX attempts_open_idx ON unitvisor.attempts (host_id) WHERE outcome IS NULL;
CREATE UNIQUE INDEX attempts_unit_name_idx ON unitvisor.attempts (unit_name);

-- The number of open attempts of each host, kept by triggers on attempts (count_open_attempt): the
-- claim's fair share and the submitter's wake trigger read one row per host instead of counting the
-- fleet's open attempts. A table of its own, not a column of hosts: the heartbeat updates the host row
-- every poll, and a counter there would make a claim's transaction hold the row the heartbeat needs.
CREATE TABLE unitvisor.host_open_attempts (
    host_id text PRIMARY KEY,
    open    integer NOT NULL DEFAULT 0
);

-- -- spawn_jobs ----------------------------------------------------------------------------------------

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
    -- Its run's concurrency key and kind (run_kind), filled in at its INSERT (describe_spawn_job): the
    -- heartbeat's and the claim's walks read the job's own row, not its run's (schema 20).
    concurrency_key text,
    kind          text,
    -- The host this job's run should not go back to for a while (033, describe_spawn_job); NULL: none.
    avoid_host    text,
    CONSTRAINT spawn_jobs_state_valid CHECK (state IN ('available', 'claimed', 'discarded')),
    CONSTRAINT spawn_jobs_claim_valid CHECK ((state = 'available') = (claimed_by IS NULL))
);

-- The claim query's scan: available jobs in claim order.
CREATE INDEX spawn_jobs_available_idx ON unitvisor.spawn_jobs (priority DESC, scheduled_at, id)
    WHERE state = 'available';
-- At most one waiting job per run: a second one could only ever start the run twice.
CREATE UNIQUE INDEX spawn_jobs_one_available_idx ON unitvisor.spawn_jobs (run_id) WHERE state = 'available';
-- Every delete of a run (and the ON DELETE CASCADE of spawn_jobs.run_id) finds its jobs here; without
-- it, each deleted run costs a scan of the whole spawn_jobs table.
CREATE INDEX spawn_jobs_run_idx ON unitvisor.spawn_jobs (run_id);
-- Retention: old claimed and discarded jobs (both have claimed_at).
CREATE INDEX spawn_jobs_done_idx ON unitvisor.spawn_jobs (claimed_at) WHERE state <> 'available';
-- The keyless jobs by kind (host_has_work's walk).
CREATE INDEX spawn_jobs_kind_idx ON unitvisor.spawn_jobs (kind, scheduled_at)
    WHERE state = 'available' AND concurrency_key IS NULL;
-- The keys that have a job waiting (a skip scan: one probe per key).
CREATE INDEX spawn_jobs_key_idx ON unitvisor.spawn_jobs (concurrency_key)
    WHERE state = 'available' AND concurrency_key IS NOT NULL;
-- The heartbeat's "a job has waited long" (its upkeep flag, as in 012): the oldest available job by
-- scheduled_at. spawn_jobs_available_idx leads with priority, so that EXISTS walked every available job
-- younger than `waited` to find none: 10,000 jobs behind a key, 10,000 rows on every heartbeat of every host.
CREATE INDEX spawn_jobs_due_idx ON unitvisor.spawn_jobs (scheduled_at) WHERE state = 'available';

-- -- hosts ---------------------------------------------------------------------------------------------

-- Every epoch any host ever gets comes from here, so none is ever given twice: a host forgotten and
-- registered again does not make its first life's fence valid again.
CREATE SEQUENCE unitvisor.host_epochs;

-- One row per host id: what its daemon registered it may run, whether it is alive, and its fence.
-- What a host may run is registered here, so that the claim (and the explanation of why a run waits)
-- is decided by the database from the same facts for every host.
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
    -- Bumped whenever ownership of the host id changes hands: declared dead, or registered by a
    -- different machine (instance). A write carrying an older epoch is refused (check_fence).
    epoch          bigint NOT NULL DEFAULT nextval('unitvisor.host_epochs'),
    -- Which machine and boot holds this id now (a hash of machine id and boot id): a restart on the
    -- same machine keeps the epoch, another machine with the same id is a conflict.
    instance       text,
    -- What this host may run, as its daemon registered it (the claim filters on these).
    can_start      boolean NOT NULL DEFAULT true,
    cannot_start_reason text,
    allowed_executables text[] NOT NULL DEFAULT '{}',  -- the globs, for people
    executable_patterns text[] NOT NULL DEFAULT '{}',  -- the same, as anchored regexes
    run_user       text NOT NULL DEFAULT '',           -- '' is a DynamicUser per run
    allowed_users  text[] NOT NULL DEFAULT '{}',
    -- Timing the host runs with: others declare it dead by its own host_dead_after, which its
    -- stop_runs_when_cut_off timing was computed from.
    poll_interval_sec double precision,
    dead_after_sec double precision,
    dead_at        timestamptz,
    drained_before_death boolean NOT NULL DEFAULT false,  -- it comes back draining
    dead_reason    text,
    -- The last time a second daemon tried to use this id while it was held (a cloned machine id, a
    -- reused [host] id), and who it was.
    conflict_at    timestamptz,
    conflict_detail text,
    -- The environment names a host refuses (supervisor/envpolicy.py: names that change what an allowed
    -- program runs) and those it opens anyway ([runs] allowed_environment), as anchored regular
    -- expressions registered by its daemon. NULL: a daemon of 0.2.0, which refused no name.
    environment_denied text[],
    environment_allowed text[],
    -- The allowlist of environment names (0.6 and later; refused_environment_name says the rule).
    -- NULL: a daemon before 0.6, which refuses by its denylist only.
    environment_names text[],
    environment_patterns text[],
    -- Admission by pressure (supervisor/pressure.py): off (PSI cannot be read, or not watched), open,
    -- slowed (claiming fewer) or stopped (claiming none); NULL: never reported by this host's daemon.
    pressure_state text,
    -- The resource whose figure decided (memory, io or cpu); NULL when off.
    pressure_resource text,
    -- avg10 of `some`, in percent, by resource, as last reported, and why admission is off.
    pressure_figures jsonb,
    pressure_detail text,
    pressure_at    timestamptz,
    -- It stopped cleanly while draining (mark_host_stopped), or was drained while stopped (set_host_state):
    -- it comes back draining at its next registration, which clears this. Kept if a stopped host with
    -- runs open is declared dead (drained_before_death says the same of a host draining at its death).
    left_draining  boolean NOT NULL DEFAULT false,
    -- Its daemon's [host] labels (033), and when it registered them (host_labels: void before started_at).
    labels         jsonb,
    labels_at      timestamptz,
    -- The operator's word that the host is down (confirm_host_down, 036): declared once overdue whatever
    -- the fleet-wide guards say; ended when the host is heard from again, or declared.
    down_confirmed_at timestamptz,
    down_confirmed_by text,
    -- When it was last heard from after being silent past its host_dead_after, not declared (036):
    -- declare_dead gives every silent host its host_dead_after again from then.
    returned_late_at timestamptz,
    -- The heartbeat's last "no work" (041): what it was read from (work_mark) and until when it holds by
    -- the clock alone (work_until); a heartbeat with the same mark before then does not walk the queue.
    work_mark      text,
    work_until     timestamptz,
    -- When its daemon said it listens on host_wake_channel(id) (register_wake_channel, 048): void before
    -- started_at, as labels_at, so that a daemon of 0.11.0 registering the id is told on unitvisor_spawn.
    wake_channel_at timestamptz,
    CONSTRAINT hosts_state_valid CHECK (state IN ('active', 'draining', 'stopped', 'dead')),
    CONSTRAINT hosts_pressure_state_valid
        CHECK (pressure_state IS NULL OR pressure_state IN ('off', 'open', 'slowed', 'stopped'))
);

-- Which login role is which host. Readable by the admin only: which role names exist, and which host
-- each is, is nobody else's business. One role per host id and one host id per role.
CREATE TABLE unitvisor.host_roles (
    role_name  text PRIMARY KEY,
    host_id    text NOT NULL UNIQUE,
    created_at timestamptz NOT NULL DEFAULT now()
);

-- -- history and explanations --------------------------------------------------------------------------

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
-- The run events that stand for a change (every one but explain_waiting's), for queue_mark (043).
CREATE INDEX run_events_change_idx ON unitvisor.run_events (id)
    WHERE NOT (state = 'queued' AND reason LIKE 'waiting: %');

-- Why a queued run waits when no live host accepts it (no row: some live host would take it).
-- A table of its own, not a column of runs: version 0.1.0 read runs and attempts with SELECT * into
-- dataclasses that refuse a field they do not know.
CREATE TABLE unitvisor.run_waits (
    run_id uuid PRIMARY KEY REFERENCES unitvisor.runs (id) ON DELETE CASCADE,
    reason text NOT NULL
);

-- The fleet upkeep's lease: one row. turn_at is when a daemon last took the turn; explained_* is where
-- the last explain_waiting pass stopped (the key of the last job it looked at), so that a backlog
-- longer than one pass is explained a batch per pass, every run in turn, never the same batch for ever.
CREATE TABLE unitvisor.fleet_upkeep (
    id boolean PRIMARY KEY DEFAULT true CHECK (id),
    turn_at timestamptz NOT NULL DEFAULT '-infinity',
    turn_host text,
    explained_at timestamptz,
    explained_job bigint,
    -- The last time declare_dead held its declarations because something was behind (036: declarer-late,
    -- fleet-late, fleet-silent): silent hosts get
    -- their host_dead_after again from then (a grace after a disruption).
    fleet_held_at timestamptz,
    -- The last heartbeat's look for upkeep that found none (040, upkeep_looks): the looks are made again
    -- a poll interval after it, so that an idle fleet is looked at once an interval, not every heartbeat.
    looked_at timestamptz NOT NULL DEFAULT '-infinity',
    -- What the last round of explain_waiting started from (042, wait_mark), and until when that holds by
    -- the clock alone: a round that would start from the same mark before then is not made.
    explained_mark text,
    explained_until timestamptz
);
INSERT INTO unitvisor.fleet_upkeep DEFAULT VALUES;

-- A cron expression's five fields, as sets: what cron_next walks.
CREATE TYPE unitvisor.cron_fields AS (
    minutes integer[],
    hours integer[],
    days integer[],
    months integer[],
    weekdays integer[],   -- 0 (Sunday) to 6; a 7 is stored as 0
    any_day boolean,      -- the day-of-month field starts with '*'
    any_weekday boolean   -- the day-of-week field starts with '*'
);

-- A schedule: `run` (submit_run_spec's keys) submitted at each due time of `cron` in `timezone`.
-- next_due is cron_next's answer, moved on by each submit_due_schedules pass that reaches it; last_*
-- say what the last pass that reached a due time did; submitted, skipped and missed count due times.
CREATE TABLE unitvisor.schedules (
    name text PRIMARY KEY CONSTRAINT schedules_name_valid CHECK (name ~ '^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$'),
    cron text NOT NULL,
    timezone text NOT NULL,
    run jsonb NOT NULL,
    overlap text NOT NULL DEFAULT 'skip' CONSTRAINT schedules_overlap_valid CHECK (overlap IN ('skip', 'queue', 'allow')),
    catch_up text NOT NULL DEFAULT 'none' CONSTRAINT schedules_catch_up_valid CHECK (catch_up IN ('none', 'one')),
    paused boolean NOT NULL DEFAULT false,
    next_due timestamptz,
    last_due timestamptz,
    last_run_id uuid,
    last_result text,
    last_at timestamptz,
    submitted bigint NOT NULL DEFAULT 0,
    skipped bigint NOT NULL DEFAULT 0,
    missed bigint NOT NULL DEFAULT 0,
    created_at timestamptz NOT NULL DEFAULT now(),
    created_by text NOT NULL DEFAULT session_user
);

-- Named fleet-wide limits (032): at most max_live runs whose labels hold every pair of selector are live
-- (starting or running) at once, across all hosts. Written only by set_limit and drop_limit, which
-- check every argument (limit_argument_problem); a claim counts each limit's live runs under the
-- limit's lock (claim_limits), so there is no counter here to drift.
CREATE TABLE unitvisor.limits (
    name     text PRIMARY KEY,
    selector jsonb NOT NULL,
    max_live integer NOT NULL,
    set_at   timestamptz NOT NULL DEFAULT now(),
    set_by   text NOT NULL DEFAULT session_user
);
-- What the heartbeat's upkeep flag and submit_due_schedules look for: due, not paused.
CREATE INDEX schedules_due ON unitvisor.schedules (next_due) WHERE NOT paused;

-- == functions: who is calling ======================================================================

-- The host id the session's login role is bound to, or NULL. session_user, not current_user: inside a
-- SECURITY DEFINER function current_user is the function's owner, and a host role cannot SET ROLE or
-- SET SESSION AUTHORIZATION its way into another login role.
CREATE FUNCTION unitvisor.my_host_id() RETURNS text
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT b.host_id FROM unitvisor.host_roles b WHERE b.role_name = session_user::text
$$;

-- Whether the session may act as host_id: the role bound to it, or any member of unitvisor_admin
-- (a superuser is a member of every role). PL/pgSQL, so that a session plans its statement once (045):
-- every host call asks it, and as a SQL function it was planned again in every transaction.
CREATE FUNCTION unitvisor.acts_as(host_id text) RETURNS boolean
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN pg_has_role(session_user, 'unitvisor_admin', 'MEMBER')
        OR EXISTS (SELECT 1 FROM unitvisor.host_roles b
                   WHERE b.role_name = session_user::text AND b.host_id = acts_as.host_id);
END $$;

-- The refusal every host write starts with. SQLSTATE 42501 (insufficient_privilege), as PostgreSQL's
-- own refusals, so that a client tells "not allowed" from "fenced" (UV001).
CREATE FUNCTION unitvisor.require_host(host_id text) RETURNS void
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NOT unitvisor.acts_as(require_host.host_id) THEN
        RAISE EXCEPTION 'role % may not act as host %', session_user, require_host.host_id
            USING ERRCODE = 'insufficient_privilege',
                  HINT = 'a host role acts only as the host id it is bound to (unitvisor hosts add); '
                         'any other host needs unitvisor_admin';
    END IF;
END $$;

-- What kind of role the session has, for `unitvisor doctor` and for people: admin, submitter, host
-- (with the host id it is bound to) or unbound (none of the three, or a host role bound to nothing).
CREATE FUNCTION unitvisor.whoami(OUT kind text, OUT host_id text)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE WHEN pg_has_role(session_user, 'unitvisor_admin', 'MEMBER') THEN 'admin'
                WHEN b.host_id IS NOT NULL THEN 'host'
                WHEN pg_has_role(session_user, 'unitvisor_submitter', 'MEMBER') THEN 'submitter'
                ELSE 'unbound' END,
           b.host_id
    FROM (SELECT unitvisor.my_host_id() AS host_id) b
$$;

-- == functions: runs, for control planes (the submitter's API: docs/sql-api.md) =====================

-- submit_run: the one way to create a run, for the CLI and for any control plane in any language.
-- It inserts the run, its first spawn job and its first event, so calling it inside the caller's
-- own transaction makes "the run exists" and "the run will be started" one atomic fact. Each
-- argument refused gets its own error, naming the argument and its check (run_argument_problem,
-- docs/sql-api.md); new arguments come last and defaulted, so that every call written for an
-- earlier schema, positional or named, keeps its meaning.
--
--   SELECT unitvisor.submit_run(ARRAY['/usr/bin/env', 'echo', 'hi'], memory_max => 268435456);
-- As 017's, with its checks replaced by one call of run_argument_problem (022), and a NULL where the
-- column has none reported from the column's refusal; hold last (030): a run submitted held is queued
-- without a spawn job; concurrency_limit (032), host_labels and avoid_failed_host (033: placement,
-- placement_problem checks them), river_job_id (034: the River job the run was made from), after and
-- after_policy (035: dependencies; check_after checks them) last.
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
    max_lost_attempts     integer DEFAULT 3,
    -- 030: hold (held at once: queued, never claimed until release_run).
    hold                  boolean DEFAULT false,
    -- 032: how many runs of its concurrency_key may be live at once (1: one at a time, as before).
    concurrency_limit     integer DEFAULT 1,
    -- 033: placement. Labels every host that runs it must have ([host] labels), and whether a retry
    -- prefers another host than the one its last attempt failed on (NULL: after a lost attempt only).
    host_labels           jsonb   DEFAULT '{}'::jsonb,
    avoid_failed_host     boolean DEFAULT NULL,
    -- 034: the River job this run was made from (River source, docs/river.md); one run per job.
    river_job_id          bigint  DEFAULT NULL,
    -- 035: the runs it runs after, and what it needs of them ('succeeded', the default, or 'finished').
    after                 uuid[]  DEFAULT NULL,
    after_policy          text    DEFAULT NULL
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
    placement record;
    -- 035: the runs named in after, each once, in the order given (NULL: none).
    parents uuid[] := unitvisor.after_ids(submit_run.after);
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
        fail_rules, submit_run.count_lost, submit_run.max_lost_attempts,
        submit_run.concurrency_limit);
    IF problem.hint IS NOT NULL THEN
        RAISE EXCEPTION '%', problem.message
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs',
                  CONSTRAINT = problem.constraint_name, HINT = problem.hint;
    ELSIF problem.message IS NOT NULL THEN
        RAISE EXCEPTION '%', problem.message
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs', CONSTRAINT = problem.constraint_name;
    END IF;
    -- Placement's own check (033), beside run_argument_problem's: the table's trigger runs_placement_valid asks it too.
    placement := unitvisor.placement_problem(coalesce(submit_run.host_labels, '{}'::jsonb));
    IF placement.message IS NOT NULL THEN
        RAISE EXCEPTION '%', placement.message
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs', CONSTRAINT = placement.constraint_name;
    END IF;

    -- 034: River's ids are bigserial, from 1. Checked here, where the argument is named (the column's
    -- CHECK, runs_river_job_id_valid, is the backstop for a write that does not come through here).
    IF submit_run.river_job_id <= 0 THEN
        RAISE EXCEPTION 'river_job_id: must be a River job''s id (a positive bigint), or NULL (none)'
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs',
                  CONSTRAINT = 'runs_river_job_id_valid';
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

    -- 035: after and after_policy, checked in one place (check_after). After the look-up, as the
    -- deadline: a retried submit finds its run even once a run it named has been pruned.
    PERFORM unitvisor.check_after(parents, submit_run.after_policy);

    -- A constraint this function did not foresee (one added later) must not leak the row either:
    -- caught, and raised again with its name but without the DETAIL that holds the row.
    BEGIN
        INSERT INTO unitvisor.runs (argv, environment, working_directory, run_user, memory_max,
            cpu_quota_percent, tasks_max, io_weight, runtime_max_sec, max_attempts, host_pin, priority,
            retry_backoff_sec, retry_backoff_max_sec, retry_on, private_network, idempotency_key, labels,
            concurrency_key, not_before, start_deadline, memory_high,
            stop_signal, stop_timeout, warn_before, warn_signal, fail_on, count_lost, max_lost_attempts,
            held_at, held_by, concurrency_limit, host_labels, avoid_failed_host, river_job_id, after_policy)
        VALUES (submit_run.argv, env, submit_run.working_directory,
            submit_run.run_user, submit_run.memory_max, submit_run.cpu_quota_percent, submit_run.tasks_max,
            submit_run.io_weight, submit_run.runtime_max_sec, submit_run.max_attempts, submit_run.host_pin,
            submit_run.priority, submit_run.retry_backoff_sec, submit_run.retry_backoff_max_sec,
            retry_rules, coalesce(submit_run.private_network, false), submit_run.idempotency_key,
            run_labels, submit_run.concurrency_key, submit_run.not_before, submit_run.start_deadline,
            submit_run.memory_high,
            run_stop_signal, submit_run.stop_timeout, submit_run.warn_before, run_warn_signal,
            fail_rules, submit_run.count_lost, submit_run.max_lost_attempts,
            CASE WHEN submit_run.hold THEN now() END, CASE WHEN submit_run.hold THEN session_user END,
            submit_run.concurrency_limit, coalesce(submit_run.host_labels, '{}'::jsonb),
            submit_run.avoid_failed_host, submit_run.river_job_id,
            CASE WHEN parents IS NOT NULL THEN coalesce(submit_run.after_policy, 'succeeded') END)
        -- Another submit with the same key committed since the look-up above (this waited for it):
        -- insert nothing, and return its run below.
        ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
        RETURNING id INTO new_id;
        IF new_id IS NULL THEN
            SELECT r.id INTO STRICT new_id FROM unitvisor.runs r WHERE r.idempotency_key = submit_run.idempotency_key;
            RETURN new_id;
        END IF;
        -- not_before: the first job is not due before it (the claim takes only due jobs). A held run
        -- gets none: release_run makes it (a held run holds no job, so no claim ever looks at it).
        -- A run with dependencies gets none either: settle_dependencies makes it once every run it names
        -- has ended as it needs (at once, below, when they all have), or ends it skipped.
        IF NOT coalesce(submit_run.hold, false) AND parents IS NULL THEN
            INSERT INTO unitvisor.spawn_jobs (run_id, priority, scheduled_at)
            VALUES (new_id, submit_run.priority, greatest(now(), submit_run.not_before));
        END IF;
        INSERT INTO unitvisor.run_events (run_id, state, reason)
        VALUES (new_id, 'queued', CASE WHEN coalesce(submit_run.hold, false) THEN 'submitted, held by ' || session_user
                                       ELSE 'submitted' END);
        IF parents IS NOT NULL THEN
            INSERT INTO unitvisor.run_dependencies (run_id, after_id) SELECT new_id, p FROM unnest(parents) p;
            PERFORM unitvisor.settle_dependencies(new_id);
        END IF;
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

-- A 1 MB environment value was accepted and the run then failed at exec (203/EXEC: E2BIG); a
-- 100,000-character host_pin was accepted. The bounds, each from the limit it protects, all here:
--
-- * argv elements and environment entries are what execve(2) takes. Linux refuses a single string
--   longer than MAX_ARG_STRLEN, 32 pages = 131072 bytes with its NUL: an argv element, and an
--   environment entry NAME=value, may be at most 131071 bytes.
-- * argv as a whole, and the environment as a whole, at most 524288 bytes (512 KiB) each, counted as
--   the kernel counts them against ARG_MAX: each string's bytes, its NUL, and its 8-byte pointer.
--   Linux's ARG_MAX is a quarter of the stack limit, 2 MiB with the usual 8 MiB; the two halves of
--   1 MiB leave the other MiB for what systemd adds to the environment (PATH, INVOCATION_ID,
--   JOURNAL_STREAM, USER, HOME, ...) and for a run under a smaller stack limit. The environment reaches
--   the run through an EnvironmentFile= (supervisor/runenv.py), whose longest line (a 131071-byte
--   entry with every character escaped) stays under systemd's 1 MiB line limit (LONG_LINE_MAX).
-- * at most 256 environment names: no kernel limit, but the claim matches every name of a waiting
--   run against each host's patterns (refused_environment_name), on every claim while it waits.
-- * working_directory at most 4095 bytes: PATH_MAX, 4096 with its NUL.
-- * host_pin at most 255 characters: a host id (config.py refuses a longer [host] id).
-- * retry_on at most 64 elements: 8 outcomes worth a retry, and (027) exit statuses and signals.
-- * already bounded where their form is checked, and not repeated here: run_user (32 characters),
--   idempotency_key and concurrency_key (255 characters), labels (64 pairs of 63 and 255 characters).
--
-- A refused size raises invalid_parameter_value (22023) with a message that names the argument, its
-- size and the limit; never a value (a secret pasted into the wrong place must not reach logs).
CREATE FUNCTION unitvisor.check_run_sizes(argv text[], environment jsonb, working_directory text, host_pin text,
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

-- A path that is not normalised ('/usr/bin/../x', '//x', '/x/./y', '/x/') can never pass a host's
-- allowlist, which compares normalised paths: refuse it at submit time instead of letting it wait.
-- A trigger on new argv values, not a CHECK constraint: PostgreSQL re-checks a CHECK on every update
-- of a row, even NOT VALID, so one such run submitted before this migration would make every later
-- update of it fail (its state, its outcome, a cancel). Those old rows are refused by a host instead.
CREATE FUNCTION unitvisor.refuse_unnormalised_argv0() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.argv[1] ~ '(//|/\./|/\.\./|/\.\.?$|./$)' THEN
        RAISE EXCEPTION 'argv[0] is not a normalised absolute path'
            USING ERRCODE = 'check_violation', CONSTRAINT = 'runs_argv0_normalised',
                  HINT = 'write it without //, /./, /../ or a trailing /';
    END IF;
    RETURN NEW;
END $$;

-- Tell the daemon that holds a run's open attempt of a cancel or a freeze request (048): on its own
-- channel (host_wake_channel, payload 'cancel') when it listens there, else every daemon on
-- unitvisor_cancel, as before, each then reading its own requests.
CREATE FUNCTION unitvisor.notify_request(run_id uuid, host_id text) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    channel text := (SELECT unitvisor.own_channel(h) FROM unitvisor.hosts h WHERE h.id = notify_request.host_id);
BEGIN
    IF channel IS NOT NULL THEN
        PERFORM pg_notify(channel, 'cancel');
    ELSE
        PERFORM pg_notify('unitvisor_cancel', notify_request.run_id::text);
    END IF;
END $$;

-- Ask for a run to be cancelled. A queued run is cancelled at once (its job removed); a starting or
-- running one is marked, and its daemon (woken on its own channel since 048, else on unitvisor_cancel:
-- notify_request) stops its unit.
-- state: the run's state after it (NULL: no such run); changed: whether anything changed.
CREATE FUNCTION unitvisor.cancel_run(run_id uuid, OUT state text, OUT changed boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    -- The job first, then the run: the claim locks in the same order, so the two cannot deadlock, and
    -- a job being claimed right now makes this wait and then see the run starting.
    DELETE FROM unitvisor.spawn_jobs j WHERE j.run_id = cancel_run.run_id AND j.state = 'available';
    UPDATE unitvisor.runs r SET
        cancel_requested_at = coalesce(r.cancel_requested_at, now()), updated_at = now(),
        state = CASE WHEN r.state = 'queued' THEN 'cancelled' ELSE r.state END,
        finished_at = CASE WHEN r.state = 'queued' THEN now() ELSE r.finished_at END
    WHERE r.id = cancel_run.run_id AND r.state IN ('queued', 'starting', 'running')
    RETURNING r.state INTO cancel_run.state;
    IF NOT FOUND THEN
        SELECT r.state INTO cancel_run.state FROM unitvisor.runs r WHERE r.id = cancel_run.run_id;
        changed := false;
        RETURN;
    END IF;
    IF cancel_run.state = 'cancelled' THEN
        -- A retry's job committed while this waited for the run's row lock (its outcome was being
        -- recorded): the run is cancelled now, so that job may never start it.
        DELETE FROM unitvisor.spawn_jobs j WHERE j.run_id = cancel_run.run_id AND j.state = 'available';
    END IF;
    INSERT INTO unitvisor.run_events (run_id, attempt, host_id, state, reason)
    VALUES (cancel_run.run_id, NULL, NULL, cancel_run.state,
            CASE WHEN cancel_run.state = 'cancelled' THEN 'cancelled while queued' ELSE 'cancel requested' END);
    IF cancel_run.state <> 'cancelled' THEN  -- (048) a queued run's cancel is done: no daemon acts on it
        PERFORM unitvisor.notify_request(cancel_run.run_id, (
            SELECT a.host_id FROM unitvisor.attempts a WHERE a.run_id = cancel_run.run_id AND a.outcome IS NULL
            ORDER BY a.attempt DESC LIMIT 1));
    END IF;
    changed := true;
END $$;

-- How a held run's wait reads, in wait_reason and waited_for.
CREATE FUNCTION unitvisor.held_text(r unitvisor.runs) RETURNS text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE WHEN r.state = 'queued' AND r.held_at IS NOT NULL THEN
        format('held since %s by %s (release it: unitvisor release %s)',
               to_char(r.held_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS "UTC"'), r.held_by, r.id) END
$$;

-- Hold a queued run: it stays queued, is never claimed, and says so, until release_run. A run that is
-- starting, running or ended is refused (object_not_in_prerequisite_state): there is nothing to hold
-- back (freeze_run stops a running one where it is). state: the run's state (NULL: no such run);
-- changed: false when it was held already.
CREATE FUNCTION unitvisor.hold_run(run_id uuid, OUT state text, OUT changed boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    -- The job first, then the run, as cancel_run: the claim locks in the same order, so the two cannot
    -- deadlock, and a job being claimed right now makes this wait and then see the run starting.
    DELETE FROM unitvisor.spawn_jobs j WHERE j.run_id = hold_run.run_id AND j.state = 'available';
    SELECT r.state INTO hold_run.state FROM unitvisor.runs r WHERE r.id = hold_run.run_id FOR UPDATE;
    IF NOT FOUND THEN
        changed := false;
        RETURN;
    END IF;
    IF hold_run.state <> 'queued' THEN
        RAISE EXCEPTION 'hold: run % is %; only a queued run can be held', hold_run.run_id, hold_run.state
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = CASE WHEN hold_run.state IN ('starting', 'running')
                              THEN 'freeze a running run instead (unitvisor.freeze_run), or cancel it'
                              ELSE 'an ended run is not claimed anyway' END;
    END IF;
    -- A retry's job committed while this waited for the run's row lock: the run is held now.
    DELETE FROM unitvisor.spawn_jobs j WHERE j.run_id = hold_run.run_id AND j.state = 'available';
    UPDATE unitvisor.runs r SET held_at = now(), held_by = session_user, updated_at = now()
    WHERE r.id = hold_run.run_id AND r.held_at IS NULL;
    changed := FOUND;
    IF changed THEN
        DELETE FROM unitvisor.run_waits w WHERE w.run_id = hold_run.run_id;
        INSERT INTO unitvisor.run_events (run_id, state, reason)
        VALUES (hold_run.run_id, 'queued', 'held by ' || session_user);
    END IF;
END $$;

-- Release a held run: it gets a new spawn job, due at once (or at its not_before), and is claimed as
-- any queued run; one that still waits for the runs it runs after (035) gets it when they have ended. A backoff it was waiting out when it was held is not waited out again: releasing is
-- the operator's decision to run it. changed: false when the run is not held (or not queued).
CREATE FUNCTION unitvisor.release_run(run_id uuid, OUT state text, OUT changed boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    released record;
BEGIN
    UPDATE unitvisor.runs r SET held_at = NULL, held_by = NULL, updated_at = now()
    FROM (SELECT o.id FROM unitvisor.runs o WHERE o.id = release_run.run_id FOR UPDATE) old
    WHERE r.id = old.id AND r.state = 'queued' AND r.held_at IS NOT NULL
    RETURNING r.priority, r.not_before, r.after_policy IS NOT NULL AND r.after_met_at IS NULL AS waiting INTO released;
    IF NOT FOUND THEN
        SELECT r.state INTO release_run.state FROM unitvisor.runs r WHERE r.id = release_run.run_id;
        changed := false;
        RETURN;
    END IF;
    IF NOT released.waiting THEN
        INSERT INTO unitvisor.spawn_jobs AS j (run_id, priority, scheduled_at)
        VALUES (release_run.run_id, released.priority, greatest(now(), released.not_before))
        ON CONFLICT (run_id) WHERE state = 'available' DO NOTHING;
    END IF;
    INSERT INTO unitvisor.run_events (run_id, state, reason)
    VALUES (release_run.run_id, 'queued', 'released by ' || session_user ||
            CASE WHEN released.waiting THEN '; it still waits for the runs it runs after' ELSE '' END);
    release_run.state := 'queued';
    changed := true;
END $$;

-- Whether an attempt's freeze request waits for its host: asked, and not the request last answered.
CREATE FUNCTION unitvisor.freeze_pending(a unitvisor.attempts) RETURNS boolean
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT a.freeze_requested_at IS NOT NULL AND a.freeze_requested_at IS DISTINCT FROM a.freeze_acted_on
$$;

-- freeze_run and thaw_run: ask the host of a running run to freeze (or thaw) its unit. Written on the
-- run's open attempt, and said to the daemons on unitvisor_cancel (the owning one reads its requests:
-- freeze_requests). A run that is not running is refused (object_not_in_prerequisite_state). changed:
-- false when the unit already is, or is already asked to be, as wanted. The unit's state after the
-- host acted is in attempts.freeze_state, a refusal in freeze_refused (freeze_text says it).
CREATE FUNCTION unitvisor.request_freeze(run_id uuid, wanted text, OUT state text, OUT changed boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    open unitvisor.attempts;
    verb text := CASE WHEN wanted = 'frozen' THEN 'freeze' ELSE 'thaw' END;
BEGIN
    SELECT r.state INTO request_freeze.state FROM unitvisor.runs r WHERE r.id = request_freeze.run_id FOR UPDATE;
    IF NOT FOUND THEN
        changed := false;
        RETURN;
    END IF;
    SELECT * INTO open FROM unitvisor.attempts a
    WHERE a.run_id = request_freeze.run_id AND a.outcome IS NULL ORDER BY a.attempt DESC LIMIT 1 FOR UPDATE;
    IF request_freeze.state <> 'running' OR open.run_id IS NULL THEN
        RAISE EXCEPTION '%: run % is %; only a running run can be %', verb, request_freeze.run_id,
            request_freeze.state, wanted
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = CASE WHEN request_freeze.state = 'queued' AND wanted = 'frozen'
                              THEN 'hold a queued run instead (unitvisor.hold_run)'
                              ELSE 'only a running run has processes to freeze or thaw' END;
    END IF;
    IF (CASE WHEN unitvisor.freeze_pending(open) THEN open.freeze_wanted
             ELSE coalesce(open.freeze_state, 'thawed') END) = wanted THEN
        changed := false;
        RETURN;
    END IF;
    UPDATE unitvisor.attempts a SET freeze_wanted = wanted, freeze_requested_at = now(),
        freeze_requested_by = session_user
    WHERE a.run_id = open.run_id AND a.attempt = open.attempt;
    INSERT INTO unitvisor.run_events (run_id, attempt, host_id, state, reason)
    VALUES (open.run_id, open.attempt, open.host_id, 'running', verb || ' requested by ' || session_user);
    PERFORM unitvisor.notify_request(request_freeze.run_id, open.host_id);
    changed := true;
END $$;

CREATE FUNCTION unitvisor.freeze_run(run_id uuid, OUT state text, OUT changed boolean)
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT f.state, f.changed FROM unitvisor.request_freeze(freeze_run.run_id, 'frozen') f
$$;

CREATE FUNCTION unitvisor.thaw_run(run_id uuid, OUT state text, OUT changed boolean)
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT f.state, f.changed FROM unitvisor.request_freeze(thaw_run.run_id, 'thawed') f
$$;

-- An attempt's freeze, in words, for `show` (NULL: never asked).
CREATE FUNCTION unitvisor.freeze_text(a unitvisor.attempts) RETURNS text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE
        WHEN a.freeze_requested_at IS NULL THEN NULL
        WHEN unitvisor.freeze_pending(a) THEN
            format('%s requested by %s at %s; its host has not acted on it yet',
                   CASE WHEN a.freeze_wanted = 'frozen' THEN 'freeze' ELSE 'thaw' END, a.freeze_requested_by,
                   to_char(a.freeze_requested_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS "UTC"'))
        WHEN a.freeze_refused IS NOT NULL THEN
            format('%s refused by its host at %s: %s (the unit is %s)',
                   CASE WHEN a.freeze_wanted = 'frozen' THEN 'freeze' ELSE 'thaw' END,
                   to_char(a.freeze_acted_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS "UTC"'), a.freeze_refused,
                   coalesce(a.freeze_state, 'thawed'))
        ELSE format('%s since %s (asked by %s)', a.freeze_state,
                    to_char(a.freeze_acted_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS "UTC"'), a.freeze_requested_by)
        END
$$;

-- resume_run as in 006, for a skipped run too (035), and with the runs skipped below it when asked
-- (with_dependants). The resumed run is queued again: with a spawn job when it names no run, else
-- waiting for the runs it names again (settle_dependencies: released at once when they have all ended
-- as it needs, skipped again at once when one of them still cannot). With with_dependants, every run
-- skipped below it (a run naming it, a run naming that one, ...) is reopened the same way, the nearest
-- first, and waits for it: dependants counts them. Without it, they stay skipped.
CREATE FUNCTION unitvisor.resume_run(run_id uuid, with_dependants boolean,
                                     OUT state text, OUT changed boolean, OUT dependants integer)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    resumed record;
    below uuid;
BEGIN
    dependants := 0;
    UPDATE unitvisor.runs r SET state = 'queued', cancel_requested_at = NULL, finished_at = NULL, updated_at = now(),
        start_deadline = CASE WHEN r.start_deadline <= now() THEN NULL ELSE r.start_deadline END,
        held_at = NULL, held_by = NULL, after_met_at = NULL
    FROM (SELECT o.id, o.start_deadline FROM unitvisor.runs o WHERE o.id = resume_run.run_id FOR UPDATE) old
    WHERE r.id = old.id AND r.state IN ('failed', 'cancelled', 'expired', 'skipped')
    RETURNING r.priority, r.not_before, r.after_policy, old.start_deadline AS old_deadline,
              r.start_deadline AS new_deadline
    INTO resumed;
    IF NOT FOUND THEN
        SELECT r.state INTO resume_run.state FROM unitvisor.runs r WHERE r.id = resume_run.run_id;
        changed := false;
        RETURN;
    END IF;
    IF resumed.after_policy IS NULL THEN
        -- A job left behind by an older race is the job this run needs: keep it, never fail on it.
        INSERT INTO unitvisor.spawn_jobs AS j (run_id, priority, scheduled_at)
        VALUES (resume_run.run_id, resumed.priority, greatest(now(), resumed.not_before))
        ON CONFLICT (run_id) WHERE state = 'available' DO NOTHING;
    END IF;
    INSERT INTO unitvisor.run_events (run_id, state, reason)
    VALUES (resume_run.run_id, 'queued', 'resumed by an operator' ||
            CASE WHEN resumed.old_deadline IS DISTINCT FROM resumed.new_deadline
                 THEN format('; its start deadline %s has passed and no longer applies',
                             to_char(resumed.old_deadline AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS "UTC"'))
                 ELSE '' END);
    PERFORM unitvisor.settle_dependencies(resume_run.run_id);
    IF coalesce(resume_run.with_dependants, false) THEN
        -- Nearest first (the longest path from the resumed run): each then waits for a run reopened
        -- before it. The graph has no cycle (a run names only runs that existed before it).
        FOR below IN
            WITH RECURSIVE down(id, depth) AS (
                SELECT d.run_id, 1 FROM unitvisor.run_dependencies d JOIN unitvisor.runs c ON c.id = d.run_id
                WHERE d.after_id = resume_run.run_id AND c.state = 'skipped'
                UNION ALL
                SELECT d.run_id, down.depth + 1 FROM down
                JOIN unitvisor.run_dependencies d ON d.after_id = down.id
                JOIN unitvisor.runs c ON c.id = d.run_id
                WHERE c.state = 'skipped')
            SELECT down.id FROM down GROUP BY down.id ORDER BY max(down.depth), down.id
        LOOP
            UPDATE unitvisor.runs r SET state = 'queued', cancel_requested_at = NULL, finished_at = NULL,
                updated_at = now(), held_at = NULL, held_by = NULL, after_met_at = NULL,
                start_deadline = CASE WHEN r.start_deadline <= now() THEN NULL ELSE r.start_deadline END
            WHERE r.id = below AND r.state = 'skipped';
            CONTINUE WHEN NOT FOUND;
            INSERT INTO unitvisor.run_events (run_id, state, reason)
            VALUES (below, 'queued', format('resumed by an operator with run %s, which it runs after', resume_run.run_id));
            PERFORM unitvisor.settle_dependencies(below);
            dependants := dependants + 1;
        END LOOP;
    END IF;
    SELECT r.state INTO resume_run.state FROM unitvisor.runs r WHERE r.id = resume_run.run_id;
    changed := true;
END $$;

-- The one-argument form (006): the run alone, its skipped dependants left as they are; its body is
-- the one above. A hold left on the run when it ended (a held run cancelled or expired) is dropped by
-- both (030): resuming is the operator's decision to run it.
CREATE FUNCTION unitvisor.resume_run(run_id uuid, OUT state text, OUT changed boolean)
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT s.state, s.changed FROM unitvisor.resume_run(resume_run.run_id, false) s
$$;


-- run_status as in 005 (same columns), with the new facts: wait_reason from wait_reason() (so a run
-- held by its not_before says so), and an expired run's outcome is `expired` and its reason the
-- expiry's (an expired run may have attempts that never started; how the run ended is the expiry); a
-- skipped run's (035) likewise `skipped` and the skip's, which names the run it needed.
CREATE FUNCTION unitvisor.run_status(run_id uuid)
RETURNS TABLE (id uuid, state text, created_at timestamptz, finished_at timestamptz, attempts integer,
               attempt integer, host_id text, outcome text, exit_status text, reason text,
               cancel_requested boolean, wait_reason text, labels jsonb)
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT r.id, r.state, r.created_at, r.finished_at,
        (SELECT count(*)::integer FROM unitvisor.attempts c WHERE c.run_id = r.id),
        a.attempt, a.host_id,
        CASE WHEN r.state IN ('expired', 'skipped') THEN r.state ELSE a.outcome END,
        CASE WHEN r.state = 'skipped' THEN NULL ELSE a.exit_status END,
        CASE WHEN r.state IN ('expired', 'skipped') THEN (SELECT e.reason FROM unitvisor.run_events e
                                                           WHERE e.run_id = r.id AND e.state = r.state
                                                           ORDER BY e.id DESC LIMIT 1)
             ELSE a.reason END,
        r.cancel_requested_at IS NOT NULL,
        unitvisor.wait_reason(r),
        r.labels
    FROM unitvisor.runs r
    LEFT JOIN LATERAL (
        SELECT l.attempt, l.host_id, l.outcome, l.exit_status, l.reason FROM unitvisor.attempts l
        WHERE l.run_id = r.id ORDER BY l.attempt DESC LIMIT 1) a ON true
    WHERE r.id = run_status.run_id
$$;

-- wait_reason as in 006: a held run first (030), then the runs it waits for (035): both must clear.
CREATE FUNCTION unitvisor.wait_reason(r unitvisor.runs) RETURNS text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE WHEN r.state <> 'queued' THEN NULL
                WHEN r.held_at IS NOT NULL THEN unitvisor.held_text(r) || coalesce('; and waits for ' || unitvisor.after_text(r), '')
                WHEN unitvisor.after_text(r) IS NOT NULL THEN 'waits for ' || unitvisor.after_text(r)
                WHEN r.not_before > now() THEN format('not before %s',
                    to_char(r.not_before AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS "UTC"'))
                ELSE (SELECT w.reason FROM unitvisor.run_waits w WHERE w.run_id = r.id) END
$$;

-- The due time of a queued run's next attempt while it is still ahead and the run has had an attempt
-- (a retry waiting out its backoff, or a resumed run not due yet); NULL otherwise, and for a run the
-- caller may not see: a host role sees by the rule of the policy on runs (host_may_see), the submitter
-- and the admin every run. As the owner, past spawn_jobs' privileges, so it says only this one time.
CREATE FUNCTION unitvisor.next_attempt_at(run_id uuid) RETURNS timestamptz
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT max(j.scheduled_at)
    FROM unitvisor.runs r JOIN unitvisor.spawn_jobs j ON j.run_id = r.id
    WHERE r.id = next_attempt_at.run_id AND r.state = 'queued' AND j.state = 'available'
      AND j.scheduled_at > now()
      AND EXISTS (SELECT 1 FROM unitvisor.attempts a WHERE a.run_id = r.id)
      AND (pg_has_role(session_user, 'unitvisor_admin', 'MEMBER')
           OR pg_has_role(session_user, 'unitvisor_submitter', 'MEMBER')
           OR unitvisor.host_may_see(r.host_pin, r.id, unitvisor.my_host_id()))
$$;

-- waited_for as in 013, a held run first (030), then the runs it waits for (035): the reason of its expiry.
CREATE FUNCTION unitvisor.waited_for(r unitvisor.runs) RETURNS text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT coalesce(
        'its release: ' || unitvisor.held_text(r),
        'the runs it runs after: ' || unitvisor.after_text(r),
        unitvisor.key_blocker_text(r),
        unitvisor.limit_text(r),
        unitvisor.fleet_refusal(r),
        (SELECT format('%s attempt(s), none of which started; the last: %s', count(*),
                       (SELECT coalesce(l.outcome, 'open') || coalesce(' (' || l.reason || ')', '')
                        FROM unitvisor.attempts l WHERE l.run_id = r.id ORDER BY l.attempt DESC LIMIT 1))
         FROM unitvisor.attempts a WHERE a.run_id = r.id HAVING count(*) > 0),
        'a host to claim it')
$$;

-- runs_with_labels as in 012, newest first by submission: runs of one transaction share created_at.
CREATE FUNCTION unitvisor.runs_with_labels(labels jsonb, max_rows integer DEFAULT 100)
RETURNS TABLE (id uuid, state text, created_at timestamptz, finished_at timestamptz, attempts integer,
               attempt integer, host_id text, outcome text, exit_status text, reason text,
               cancel_requested boolean, wait_reason text, labels jsonb)
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT s.* FROM (SELECT r.id AS run_id, r.created_at AS run_created_at, r.seq AS run_seq FROM unitvisor.runs r
                     WHERE r.labels @> runs_with_labels.labels
                     ORDER BY r.created_at DESC, r.seq DESC NULLS LAST, r.id
                     LIMIT unitvisor.max_rows_bound(runs_with_labels.max_rows)) m
    CROSS JOIN LATERAL unitvisor.run_status(m.run_id) s
    ORDER BY m.run_created_at DESC, m.run_seq DESC NULLS LAST, m.run_id
$$;

-- max_rows as runs_with_labels takes it: NULL (no bound) or a count from 0; anything else is refused
-- with a message that names the argument (invalid_parameter_value, as PostgreSQL's own refusal of a
-- bad argument). Called with the caller's rights, so granted to the roles that may call
-- runs_with_labels; it reads nothing.
CREATE FUNCTION unitvisor.max_rows_bound(max_rows integer) RETURNS integer
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF max_rows < 0 THEN
        RAISE EXCEPTION 'max_rows: % is out of range (0 or more; NULL for no bound)', max_rows
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN max_rows;
END $$;

-- == functions: dependencies between runs (035) ====================================================

-- Whether a run it runs after, now in `state`, is what a run with this after_policy needs: succeeded,
-- or (for 'finished') ended in any way. A run that has ended and is not what it needs can no longer be
-- (only a resume brings it back): the dependant is skipped.
CREATE FUNCTION unitvisor.dependency_met(after_policy text, state text) RETURNS boolean
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT state = 'succeeded' OR (after_policy = 'finished' AND state = ANY (unitvisor.retention_states()))
$$;

-- submit_run's after, each run once in the order given (NULLs kept, for check_after to refuse); NULL
-- for NULL or an empty array: no dependencies.
CREATE FUNCTION unitvisor.after_ids(after uuid[]) RETURNS uuid[]
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT nullif(ARRAY(SELECT a.id FROM unnest(after) WITH ORDINALITY a(id, n)
                        GROUP BY a.id ORDER BY min(a.n)), '{}')
$$;

-- The checks of submit_run's after and after_policy, in one place, each refusal naming its argument.
-- The runs named are locked (FOR SHARE, in id order) until the submit commits: one of them ending now
-- waits for it and then settles the new run (its trigger sees the new row), or has committed already,
-- and the new run sees it ended. Any run that exists may be named: the roles that call submit_run
-- themselves (a submitter, an admin) see every run, and a host's role reaches it only through the
-- daemon's paths (submit_due_schedules; River's submit_river_run, submit_run_spec), which submit what a
-- submitter wrote. A host's own view (host_may_see) is no rule there: a schedule naming a run pinned to
-- another host, whose trial create_schedule ran as its submitter, would be refused at every due time.
CREATE FUNCTION unitvisor.check_after(after uuid[], after_policy text) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    max_after constant integer := 1000;
    missing uuid;
BEGIN
    IF check_after.after_policy IS NOT NULL AND check_after.after_policy NOT IN ('succeeded', 'finished') THEN
        RAISE EXCEPTION 'after_policy: must be succeeded or finished, not %', quote_literal(left(check_after.after_policy, 64))
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs', CONSTRAINT = 'runs_after_policy_valid';
    END IF;
    IF check_after.after IS NULL THEN
        IF check_after.after_policy IS NOT NULL THEN
            RAISE EXCEPTION 'after_policy: only with after (the runs it runs after)'
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        RETURN;
    END IF;
    IF array_position(check_after.after, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'after: must not hold NULL (each element is the id of a run it runs after)'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF cardinality(check_after.after) > max_after THEN
        RAISE EXCEPTION 'after: names % runs, at most % may be named', cardinality(check_after.after), max_after
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM 1 FROM unitvisor.runs r WHERE r.id = ANY (check_after.after) ORDER BY r.id FOR SHARE;
    SELECT a.id INTO missing FROM unnest(check_after.after) WITH ORDINALITY a(id, n)
    WHERE NOT EXISTS (SELECT 1 FROM unitvisor.runs r WHERE r.id = a.id)
    ORDER BY a.n LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'after: no run % (only a run that exists can be named)', missing
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
END $$;

-- Settle a queued run that waits for the runs it names: skipped when one of them has ended as it does
-- not need (the reason names that run); released when all have ended as it needs (after_met_at, an
-- event, and its spawn job unless it is held: release_run makes it then); else nothing. Returns what
-- it did: 'skipped', 'released', 'waiting', or NULL (not a waiting run: no such run, not queued, no
-- dependencies, released already).
--
-- The run's row is taken with an UPDATE first, and the runs it names read in the statements after it:
-- in READ COMMITTED each has its own snapshot, taken after the lock, so of two sessions ending its two
-- dependencies at once the second to get the lock sees the first's commit, and releases it, once.
-- (An UPDATE, not only a lock, so that a REPEATABLE READ session that comes second fails to serialize
-- instead of reading from before the first's commit.)
CREATE FUNCTION unitvisor.settle_dependencies(run_id uuid) RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    dependant unitvisor.runs;
    broken record;
    ended text;
    released_why text;
BEGIN
    UPDATE unitvisor.runs r SET updated_at = now()
    WHERE r.id = settle_dependencies.run_id AND r.state = 'queued' AND r.after_policy IS NOT NULL
      AND r.after_met_at IS NULL
    RETURNING r.* INTO dependant;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    SELECT p.id, p.state INTO broken FROM unitvisor.run_dependencies d JOIN unitvisor.runs p ON p.id = d.after_id
    WHERE d.run_id = dependant.id AND p.state = ANY (unitvisor.retention_states())
      AND NOT unitvisor.dependency_met(dependant.after_policy, p.state)
    ORDER BY p.finished_at, p.id LIMIT 1;
    IF FOUND THEN
        DELETE FROM unitvisor.spawn_jobs j WHERE j.run_id = dependant.id AND j.state = 'available';
        DELETE FROM unitvisor.run_waits w WHERE w.run_id = dependant.id;
        -- A state change: runs_settle_dependants settles the runs that name this one in turn.
        UPDATE unitvisor.runs r SET state = 'skipped', finished_at = now(), updated_at = now()
        WHERE r.id = dependant.id;
        INSERT INTO unitvisor.uncounted_skips (run_id) VALUES (dependant.id);
        INSERT INTO unitvisor.run_events (run_id, state, reason)
        VALUES (dependant.id, 'skipped', format('run %s, which it runs after, ended %s; it needed it to %s', broken.id,
                broken.state, CASE WHEN dependant.after_policy = 'succeeded' THEN 'succeed' ELSE 'end' END));
        RETURN 'skipped';
    END IF;
    -- No row left: every run it names was pruned (their rows go with them), which retention does only
    -- once no run that has not ended names them, so only a resumed run meets this. Nothing is left to
    -- wait for or to judge: released (waiting would be for ever, with no reason to show), and the event
    -- says why. (The aggregate below would return no row, and so 'waiting', for no row at all.)
    IF NOT EXISTS (SELECT 1 FROM unitvisor.run_dependencies d WHERE d.run_id = dependant.id) THEN
        released_why := 'the runs it runs after were pruned (retention): nothing is left to wait for';
    ELSE
        SELECT string_agg(format('%s %s', s.n, s.state), ', ' ORDER BY s.state) INTO ended
        FROM (SELECT p.state, count(*) AS n FROM unitvisor.run_dependencies d JOIN unitvisor.runs p ON p.id = d.after_id
              WHERE d.run_id = dependant.id GROUP BY p.state) s
        HAVING bool_and(unitvisor.dependency_met(dependant.after_policy, s.state));
        IF ended IS NULL THEN
            RETURN 'waiting';
        END IF;
        released_why := format('the runs it runs after have ended (%s)', ended);
    END IF;
    UPDATE unitvisor.runs r SET after_met_at = now() WHERE r.id = dependant.id;
    IF dependant.held_at IS NULL THEN
        INSERT INTO unitvisor.spawn_jobs AS j (run_id, priority, scheduled_at)
        VALUES (dependant.id, dependant.priority, greatest(now(), dependant.not_before))
        ON CONFLICT (run_id) WHERE state = 'available' DO NOTHING;
    END IF;
    INSERT INTO unitvisor.run_events (run_id, state, reason)
    VALUES (dependant.id, 'queued', released_why ||
            CASE WHEN dependant.held_at IS NOT NULL THEN '; it is still held' ELSE '' END);
    RETURN 'released';
END $$;

-- When a run ends, each run that names it is settled, one at a time in id order (so that two sessions
-- settling the same runs lock them in the same order). One index probe for a run nobody names.
CREATE FUNCTION unitvisor.settle_dependants() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    dependant uuid;
BEGIN
    FOR dependant IN SELECT d.run_id FROM unitvisor.run_dependencies d WHERE d.after_id = NEW.id ORDER BY d.run_id LOOP
        PERFORM unitvisor.settle_dependencies(dependant);
    END LOOP;
    RETURN NULL;
END $$;

-- Whether a run that is not ended names this one: retention keeps it until that run has ended.
CREATE FUNCTION unitvisor.needed_by_live_run(run_id uuid) RETURNS boolean
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT EXISTS (SELECT 1 FROM unitvisor.run_dependencies d JOIN unitvisor.runs c ON c.id = d.run_id
                   WHERE d.after_id = needed_by_live_run.run_id AND c.state <> ALL (unitvisor.retention_states()))
$$;

-- The skips no daemon has counted yet, taken by this one (each daemon's reconcile pass): how many. A
-- skip another daemon is counting right now is left to it (its row is locked, and gone once it commits).
CREATE FUNCTION unitvisor.count_skips(host_id text, host_epoch bigint) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    counted integer;
BEGIN
    PERFORM unitvisor.check_fence(count_skips.host_id, count_skips.host_epoch);
    WITH gone AS (DELETE FROM unitvisor.uncounted_skips s
                  WHERE s.ctid = ANY (ARRAY(SELECT o.ctid FROM unitvisor.uncounted_skips o FOR UPDATE SKIP LOCKED))
                  RETURNING 1)
    SELECT count(*)::integer INTO counted FROM gone;
    RETURN counted;
END $$;

-- The runs a waiting run still waits for, in words: the first submitted, and how many more ("run X
-- (running) and 2 more"). NULL when it waits for none (not queued, released, no dependencies).
CREATE FUNCTION unitvisor.after_text(r unitvisor.runs) RETURNS text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT format('run %s (%s)%s', f.id, f.state, CASE WHEN f.n > 1 THEN format(' and %s more', f.n - 1) ELSE '' END)
    FROM (SELECT p.id, p.state, count(*) OVER () AS n
          FROM unitvisor.run_dependencies d JOIN unitvisor.runs p ON p.id = d.after_id
          WHERE d.run_id = r.id AND p.state <> ALL (unitvisor.retention_states())
          ORDER BY p.created_at, p.seq, p.id LIMIT 1) f
    WHERE r.state = 'queued' AND r.after_policy IS NOT NULL AND r.after_met_at IS NULL
$$;

-- == functions: hosts, their registration, liveness and fence =======================================

-- The session-level advisory lock a live daemon holds on its host id (on its main connection): a
-- second daemon with the same id cannot take it. 64 bits of hash, so two distinct ids practically
-- never share a lock.
CREATE FUNCTION unitvisor.host_lock_key(host_id text) RETURNS bigint
LANGUAGE sql IMMUTABLE AS $$ SELECT hashtextextended('unitvisor-host:' || host_id, 0) $$;

-- check_fence, as in 002, first checking that the caller is the host it writes for. Every host write
-- that carries a fence calls it (claim_jobs, declare_dead_hosts, register_host_environment, and the
-- functions below), so none of them can be made as another host.
CREATE FUNCTION unitvisor.check_fence(host_id text, host_epoch bigint) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    current unitvisor.hosts;
BEGIN
    PERFORM unitvisor.require_host(check_fence.host_id);
    SELECT * INTO current FROM unitvisor.hosts h WHERE h.id = check_fence.host_id FOR SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'host % is fenced: its row is gone', check_fence.host_id
            USING ERRCODE = 'UV001', HINT = 'the daemon registers again';
    END IF;
    IF current.epoch <> check_fence.host_epoch OR current.state = 'dead' THEN
        RAISE EXCEPTION 'host % is fenced: epoch % is over (now %, %)', check_fence.host_id,
            check_fence.host_epoch, current.epoch, current.state
            USING ERRCODE = 'UV001', HINT = 'the daemon registers again';
    END IF;
    RETURN true;
END $$;

-- register_host as in 013, bringing a host that stopped or died while draining back draining (024).
-- Another instance is refused while the host has been heard from within its own host_dead_after and
-- either is active or draining (a live daemon, maybe reconnecting) or has an attempt open (its daemon
-- stopped, or is restarting: its runs go on, and only its own instance may adopt them; a peer settles
-- them only once it is declared dead, after the same silence). The same machine in the same boot (a restart, a reconnect) takes it back at
-- once, as before. What a refused daemon is told says when it may try with success: the moment is the
-- database's, fixed by the last heartbeat, so the message stays the same while it waits.
CREATE FUNCTION unitvisor.register_host(
    host_id text, host_name text, host_instance text, max_runs integer, memory_budget bigint,
    host_version text, host_boot_id text, allowed_executables text[], executable_patterns text[],
    run_user text, allowed_users text[], can_start boolean, cannot_start_reason text,
    poll_interval_sec double precision, dead_after_sec double precision)
RETURNS TABLE (registered boolean, state text, epoch bigint, detail text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    old unitvisor.hosts;
    new_epoch bigint;
    new_state text;
    open_attempts bigint;
    who text := format('%s (instance %s, backend pid %s)', register_host.host_name, register_host.host_instance,
                       pg_backend_pid());
BEGIN
    PERFORM unitvisor.require_host(register_host.host_id);
    IF NOT pg_try_advisory_lock(unitvisor.host_lock_key(register_host.host_id)) THEN
        UPDATE unitvisor.hosts h SET conflict_at = now(), conflict_detail = 'refused a second daemon: ' || who
        WHERE h.id = register_host.host_id;
        RETURN QUERY SELECT false, NULL::text, NULL::bigint,
            format('host id %s is held by another live daemon (its database session holds the host lock)',
                   register_host.host_id);
        RETURN;
    END IF;
    SELECT * INTO old FROM unitvisor.hosts h WHERE h.id = register_host.host_id FOR UPDATE;
    -- (A NULL instance was registered by a version-1 daemon, which recorded none: the usual case is
    -- this machine's own daemon before an upgrade, so it is not held against it.)
    IF FOUND AND old.instance IS NOT NULL AND old.instance <> register_host.host_instance
            AND old.heartbeat_at >= now() - make_interval(secs => coalesce(old.dead_after_sec, 60)) THEN
        SELECT count(*) INTO open_attempts FROM unitvisor.attempts a
        WHERE a.host_id = register_host.host_id AND a.outcome IS NULL;
        IF old.state IN ('active', 'draining') OR open_attempts > 0 THEN
            -- Held: let its instance have it back (or its silence run out).
            PERFORM pg_advisory_unlock(unitvisor.host_lock_key(register_host.host_id));
            UPDATE unitvisor.hosts h SET conflict_at = now(), conflict_detail = 'refused a second daemon: ' || who
            WHERE h.id = register_host.host_id;
            RETURN QUERY SELECT false, NULL::text, NULL::bigint, format(
                'host id %s is held by instance %s (another machine with this id, or this machine before a '
                'reboot), %s with %s attempt(s) open, last heard from at %s; another instance may take it once '
                'it has been silent for its host_dead_after (%s s), at %s',
                register_host.host_id, old.instance, old.state, open_attempts,
                to_char(old.heartbeat_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS "UTC"'),
                coalesce(old.dead_after_sec, 60),
                to_char((old.heartbeat_at + make_interval(secs => coalesce(old.dead_after_sec, 60)))
                        AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS "UTC"'));
            RETURN;
        END IF;
    END IF;
    IF NOT FOUND THEN
        INSERT INTO unitvisor.hosts (id, name, max_runs, memory_budget, version, boot_id, instance, can_start,
            cannot_start_reason, allowed_executables, executable_patterns, run_user, allowed_users,
            poll_interval_sec, dead_after_sec)
        VALUES (register_host.host_id, register_host.host_name, register_host.max_runs, register_host.memory_budget,
            register_host.host_version, register_host.host_boot_id, register_host.host_instance,
            register_host.can_start, register_host.cannot_start_reason, register_host.allowed_executables,
            register_host.executable_patterns, register_host.run_user, register_host.allowed_users,
            register_host.poll_interval_sec, register_host.dead_after_sec)
        RETURNING hosts.epoch INTO new_epoch;
        RETURN QUERY SELECT true, 'active'::text, new_epoch, 'registered'::text;
        RETURN;
    END IF;
    -- Same machine (a restart, a reconnect): same epoch, its attempts are its own. A dead host, or
    -- another instance taking over the id: a new epoch, so that the old owner's writes fail.
    new_epoch := CASE WHEN old.state = 'dead' OR old.instance IS DISTINCT FROM register_host.host_instance
                      THEN nextval('unitvisor.host_epochs') ELSE old.epoch END;
    -- A drain outlives a clean stop (left_draining) and a death (drained_before_death, or left_draining
    -- if it had stopped drained first): the host claims nothing until `undrain`.
    new_state := CASE WHEN old.state = 'draining' OR (old.state IN ('stopped', 'dead') AND old.left_draining)
                           OR (old.state = 'dead' AND old.drained_before_death)
                      THEN 'draining' ELSE 'active' END;
    -- started_at = now(): the start of this registration, which declare_dead_hosts measures the
    -- declarer's connection by (a daemon registers after every connect).
    UPDATE unitvisor.hosts h SET name = register_host.host_name, max_runs = register_host.max_runs,
        memory_budget = register_host.memory_budget, version = register_host.host_version,
        boot_id = register_host.host_boot_id, instance = register_host.host_instance,
        can_start = register_host.can_start, cannot_start_reason = register_host.cannot_start_reason,
        allowed_executables = register_host.allowed_executables,
        executable_patterns = register_host.executable_patterns, run_user = register_host.run_user,
        allowed_users = register_host.allowed_users, poll_interval_sec = register_host.poll_interval_sec,
        dead_after_sec = register_host.dead_after_sec, epoch = new_epoch, started_at = now(),
        heartbeat_at = now(), dead_at = NULL, dead_reason = NULL, drained_before_death = false,
        left_draining = false, state = new_state
    WHERE h.id = register_host.host_id;
    RETURN QUERY SELECT true, new_state, new_epoch,
        CASE WHEN old.state = 'dead' THEN format('rejoined after being declared dead (%s)', old.dead_reason)
             WHEN new_epoch <> old.epoch THEN format('took over the id from instance %s', old.instance)
             ELSE 'registered' END;
END $$;

-- As in 003 (what a 0.5.x daemon calls), and it also clears an allowlist a 0.6 daemon registered for
-- the same host id: after a downgrade the host is judged by the denylist its daemon enforces, never by
-- a list that daemon does not know.
CREATE FUNCTION unitvisor.register_host_environment(host_id text, host_epoch bigint,
    environment_denied text[], environment_allowed text[]) RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    UPDATE unitvisor.hosts h SET environment_denied = register_host_environment.environment_denied,
        environment_allowed = register_host_environment.environment_allowed,
        environment_names = NULL, environment_patterns = NULL
    WHERE h.id = register_host_environment.host_id
      AND unitvisor.check_fence(register_host_environment.host_id, register_host_environment.host_epoch)
$$;

-- What a 0.6 daemon registers right after register_host, in the same transaction (store.register_host),
-- fenced like every host write. environment_allowed is cleared: the allowlist decides.
CREATE FUNCTION unitvisor.register_host_allowlist(host_id text, host_epoch bigint, environment_denied text[],
    environment_names text[], environment_patterns text[]) RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    UPDATE unitvisor.hosts h SET environment_denied = register_host_allowlist.environment_denied,
        environment_allowed = NULL,
        environment_names = coalesce(register_host_allowlist.environment_names, '{}'),
        environment_patterns = coalesce(register_host_allowlist.environment_patterns, '{}')
    WHERE h.id = register_host_allowlist.host_id
      AND unitvisor.check_fence(register_host_allowlist.host_id, register_host_allowlist.host_epoch)
$$;

-- What a daemon of this release registers right after register_host, in the same transaction
-- (store.register_host), fenced like every host write: its [host] labels, checked as a run's labels are.
CREATE FUNCTION unitvisor.register_host_labels(host_id text, host_epoch bigint, labels jsonb) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM unitvisor.check_fence(register_host_labels.host_id, register_host_labels.host_epoch);
    IF register_host_labels.labels IS NULL OR NOT unitvisor.labels_are_valid(register_host_labels.labels) THEN
        RAISE EXCEPTION 'labels: must be a JSON object of at most 64 key -> string pairs, each as a run''s label'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    UPDATE unitvisor.hosts h SET labels = register_host_labels.labels, labels_at = now()
    WHERE h.id = register_host_labels.host_id;
END $$;

-- The channel on which a host's daemon is told of jobs that name it alone (048): a function of its id, at
-- most 48 bytes whatever the id (a channel name is at most 63; a host id up to 255 characters).
CREATE FUNCTION unitvisor.host_wake_channel(host_id text) RETURNS text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT 'unitvisor_spawn_' || left(encode(sha256(convert_to(host_wake_channel.host_id, 'UTF8')), 'hex'), 32)
$$;

-- The channel a host's daemon listens on alone (048), or NULL: a daemon of 0.11.0, or a mark from before the
-- host's last registration (wake_channel_at is void before started_at, as labels_at). What
-- notify_spawn_targets and notify_request both ask.
CREATE FUNCTION unitvisor.own_channel(h unitvisor.hosts) RETURNS text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE WHEN h.wake_channel_at >= h.started_at THEN unitvisor.host_wake_channel(h.id) END
$$;

-- What a daemon of this release registers right after register_host, in the same transaction, having sent
-- LISTEN on the channel it returns there too (store.register_wake_channel): from that commit on, a
-- notification that names this host alone goes to that channel (notify_spawn_targets).
CREATE FUNCTION unitvisor.register_wake_channel(host_id text, host_epoch bigint) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM unitvisor.check_fence(register_wake_channel.host_id, register_wake_channel.host_epoch);
    UPDATE unitvisor.hosts h SET wake_channel_at = now() WHERE h.id = register_wake_channel.host_id;
    RETURN unitvisor.host_wake_channel(register_wake_channel.host_id);
END $$;

-- What a daemon reports when its admission changes (store.set_pressure), fenced like every host write.
-- Not part of the heartbeat: a host stops claiming within a second or two of its figure crossing the
-- line, not at its next poll interval, and an idle host, whose figures do not move, writes nothing.
CREATE FUNCTION unitvisor.set_host_pressure(host_id text, host_epoch bigint, state text, resource text,
    figures jsonb, detail text) RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    UPDATE unitvisor.hosts h SET pressure_state = set_host_pressure.state,
        pressure_resource = set_host_pressure.resource, pressure_figures = set_host_pressure.figures,
        pressure_detail = set_host_pressure.detail, pressure_at = now()
    WHERE h.id = set_host_pressure.host_id
      AND unitvisor.check_fence(set_host_pressure.host_id, set_host_pressure.host_epoch)
$$;

-- Whether the fleet has upkeep to do, for the heartbeat of host `me` (heartbeat's upkeep flag, the turn
-- being due): a silent host other than `me`, a job due for longer than `waited`, or a queued run past its
-- start deadline. Once an `every` while none of them is there: a look that finds nothing stamps
-- fleet_upkeep.looked_at, and a look within `every` of that stamp is not made (false).
CREATE FUNCTION unitvisor.upkeep_looks(me text, waited interval, every interval) RETURNS boolean
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    found boolean;
BEGIN
    IF (SELECT u.looked_at FROM unitvisor.fleet_upkeep u) > now() - upkeep_looks.every THEN
        RETURN false;
    END IF;
    found := EXISTS (SELECT 1 FROM unitvisor.hosts o WHERE o.id <> upkeep_looks.me AND unitvisor.host_is_overdue(o))
          OR EXISTS (SELECT 1 FROM unitvisor.spawn_jobs j
                     WHERE j.state = 'available' AND j.scheduled_at <= now() - upkeep_looks.waited)
          OR EXISTS (SELECT 1 FROM unitvisor.runs r
                     WHERE r.state = 'queued' AND r.start_deadline <= now() AND unitvisor.is_overdue(r));
    IF NOT found THEN
        UPDATE unitvisor.fleet_upkeep u SET looked_at = now()
        WHERE u.id IN (SELECT v.id FROM unitvisor.fleet_upkeep v
                       WHERE v.looked_at <= now() - upkeep_looks.every FOR UPDATE SKIP LOCKED);
    END IF;
    RETURN found;
END $$;

-- The columns of a host row that host_has_work and host_refusal read, as one hash: a drain or undrain, a
-- new profile at registration, a pressure state, new labels, a restart (started_at) or a new epoch change
-- it; a heartbeat (heartbeat_at) or a pressure sample within the same state does not. Named, not the
-- whole row (to_jsonb less the columns that move on their own cost 16 us a heartbeat against 3): a
-- column that host_refusal comes to read is added here.
CREATE FUNCTION unitvisor.host_refusal_inputs(h unitvisor.hosts) RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT hashtextextended(row(h.state, h.can_start, h.cannot_start_reason, h.max_runs, h.memory_budget,
                                h.executable_patterns, h.run_user, h.allowed_users, h.environment_denied,
                                h.environment_allowed, h.environment_names, h.environment_patterns,
                                h.pressure_state, h.pressure_resource, unitvisor.host_labels(h), h.started_at,
                                h.epoch,
                                -- host_refusal reads pressure_at only against started_at
                                h.pressure_at >= h.started_at)::text, 0)
$$;

-- The queue's part of a mark (this heartbeat's, and 042's for the fleet upkeep): the newest spawn job's id
-- and the newest run event's id that is not an explanation of a wait (043: those change no run's state
-- and no host's work), two newest-first probes of an index each. With the host's
-- host_refusal_inputs, 6 us in all, against 8 us for host_has_work on an idle queue (a throwaway
-- PostgreSQL 15).
CREATE FUNCTION unitvisor.queue_mark() RETURNS text
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN format('%s/%s', coalesce((SELECT max(j.id) FROM unitvisor.spawn_jobs j), 0),
                  coalesce((SELECT max(e.id) FROM unitvisor.run_events e
                            WHERE NOT (e.state = 'queued' AND e.reason LIKE 'waiting: %')), 0));
END $$;

-- When the clock alone next changes what the queue holds for a look that counts jobs due for `waited`:
-- the earliest available job not yet due that long, at the moment it will be; NULL when there is none.
CREATE FUNCTION unitvisor.next_due(waited interval) RETURNS timestamptz
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN (SELECT min(j.scheduled_at) FROM unitvisor.spawn_jobs j
            WHERE j.state = 'available' AND j.scheduled_at > now() - next_due.waited) + next_due.waited;
END $$;

-- heartbeat as in 020, its upkeep flag true only while the fleet's turn is due (a poll interval after the
-- last turn was given, fleet_upkeep_turn's own rule): then one or two daemons ask for the turn an
-- interval, not every daemon of the fleet. Since 028 the flag is also set while a schedule is due,
-- turn or not (the step that submits schedules' runs is every flagged daemon's, not the turn's; and a
-- schedule is due for moments only).
-- Since 030 its `cancels` is also true while a freeze request of this host waits: the poll that makes
-- up for a lost notification (a 0.8.0 daemon then looks for cancels, and finds none).
-- Since 040 its looks are upkeep_looks': once a poll interval while the fleet is idle.
-- Since 041 its claimable is host_has_work's only when the host's work_mark moved or its work_until
-- passed: a "no" walked for is remembered on the host row (the head of 041 says what the mark holds).
-- Since 047 a job due when it was made is not its claimable for `left_to_woken` (the daemon's
-- spread grace, 1 s; 0, the default, for a caller that does not say): see the head of 047.
CREATE FUNCTION unitvisor.heartbeat(host_id text, host_epoch bigint, waited interval,
                                    left_to_woken interval DEFAULT '0')
RETURNS TABLE (host_state text, claimable boolean, cancels boolean, upkeep boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    me unitvisor.hosts;
    mark text;
    has_work boolean := false;
    until timestamptz;
BEGIN
    PERFORM unitvisor.require_host(heartbeat.host_id);
    -- An empty queue is no work, and costs one index probe: no mark (an idle fleet's heartbeat is most of
    -- its cost; reading the host row and its mark at every heartbeat cost 0.2 ms more in bench.scale).
    IF EXISTS (SELECT 1 FROM unitvisor.spawn_jobs j WHERE j.state = 'available') THEN
        SELECT * INTO me FROM unitvisor.hosts h
        WHERE h.id = heartbeat.host_id AND h.epoch = heartbeat.host_epoch AND h.state <> 'dead';
    END IF;
    IF me.id IS NOT NULL THEN
        -- The mark is read before the walk: see the head of 041.
        mark := unitvisor.queue_mark() || '/' || unitvisor.host_refusal_inputs(me);
        IF mark IS DISTINCT FROM me.work_mark OR NOT now() < me.work_until THEN
            has_work := unitvisor.host_has_work(me, heartbeat.left_to_woken);
            IF NOT has_work THEN
                -- 047: and when the youngest job left to the hosts its submit woke is left no more
                until := least(now() + 30 * make_interval(secs => coalesce(me.poll_interval_sec, 10)),
                               unitvisor.next_due('0'),
                               CASE WHEN heartbeat.left_to_woken > '0' THEN unitvisor.next_due(heartbeat.left_to_woken) END);
            END IF;
        ELSE
            until := me.work_until;
        END IF;
    END IF;
    RETURN QUERY
    UPDATE unitvisor.hosts h SET heartbeat_at = now(),
        work_mark = CASE WHEN has_work THEN NULL ELSE mark END, work_until = until
    WHERE h.id = heartbeat.host_id AND h.epoch = heartbeat.host_epoch AND h.state <> 'dead'
    RETURNING h.state,
        has_work,
        EXISTS (SELECT 1 FROM unitvisor.attempts a JOIN unitvisor.runs r ON r.id = a.run_id
                WHERE a.host_id = heartbeat.host_id AND a.outcome IS NULL
                  AND (r.cancel_requested_at IS NOT NULL OR unitvisor.freeze_pending(a))),
        -- The turn first: while it is not due, the looks are not made.
        ((SELECT u.turn_at FROM unitvisor.fleet_upkeep u) <= now() - make_interval(secs => coalesce(h.poll_interval_sec, 10))
         AND unitvisor.upkeep_looks(h.id, heartbeat.waited, make_interval(secs => coalesce(h.poll_interval_sec, 10))))
        OR EXISTS (SELECT 1 FROM unitvisor.schedules s WHERE NOT s.paused AND s.next_due <= now());
END $$;

-- A daemon's clean stop (store.mark_host_stopped): an active or a draining host becomes 'stopped', and a
-- draining one keeps its drain in left_draining. Its heartbeat is stamped, so that a stop is a fresh
-- sign of life (a host stopped with runs open is held for its host_dead_after from here).
CREATE FUNCTION unitvisor.mark_host_stopped(host_id text, host_epoch bigint) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM unitvisor.require_host(mark_host_stopped.host_id);
    UPDATE unitvisor.hosts h SET state = 'stopped', heartbeat_at = now(), left_draining = (h.state = 'draining')
    WHERE h.id = mark_host_stopped.host_id AND h.epoch = mark_host_stopped.host_epoch
      AND h.state IN ('active', 'draining');
END $$;

-- The previous state (NULL: no such host). A dead host stays dead: it becomes active again only by
-- registering. A stopped host stays stopped (a silent host made 'active' or 'draining' would be overdue,
-- and declared dead); the drain is kept in left_draining for its next registration, and its previous
-- state is said as `stopped` or `stopped (drained)`.
CREATE FUNCTION unitvisor.set_host_state(host_id text, state text) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    old unitvisor.hosts;
BEGIN
    PERFORM unitvisor.require_host(set_host_state.host_id);
    IF set_host_state.state IS NULL OR set_host_state.state NOT IN ('active', 'draining') THEN
        RAISE EXCEPTION 'a host''s state is set to active or draining, not %', coalesce(set_host_state.state, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO old FROM unitvisor.hosts h WHERE h.id = set_host_state.host_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF old.state = 'stopped' THEN
        UPDATE unitvisor.hosts h SET left_draining = (set_host_state.state = 'draining')
        WHERE h.id = set_host_state.host_id;
        RETURN CASE WHEN old.left_draining THEN 'stopped (drained)' ELSE 'stopped' END;
    END IF;
    IF old.state <> 'dead' AND old.state <> set_host_state.state THEN
        UPDATE unitvisor.hosts h SET state = set_host_state.state WHERE h.id = set_host_state.host_id;
    END IF;
    RETURN old.state;
END $$;

-- A host is live while it is active and has been heard from within its own host_dead_after (whether
-- it can start units is host_refusal's to say, so that a waiting run names the reason).
CREATE FUNCTION unitvisor.host_is_live(h unitvisor.hosts) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT h.state = 'active' AND h.heartbeat_at >= now() - make_interval(secs => coalesce(h.dead_after_sec, 60))
$$;

-- Whether the host has an attempt that no outcome settled yet (host_is_overdue's question about a
-- stopped host, in a function of its own so that host_is_overdue has no subquery).
CREATE FUNCTION unitvisor.host_has_open_attempt(host_id text) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM unitvisor.attempts a
                   WHERE a.host_id = host_has_open_attempt.host_id AND a.outcome IS NULL)
$$;

-- A host to declare dead: silent for longer than its own host_dead_after, and either active or
-- draining, or stopped with an attempt still open (a host that stopped cleanly with nothing open
-- stays 'stopped', and since 024 a drained one stops too: so a drained host stopped for maintenance or
-- retirement is never declared dead). The heartbeat's probe and declare_dead_hosts both ask this one function.
-- Inlined by the planner (since schema 29: no subquery, no SET, not SECURITY DEFINER or STRICT), so
-- that the heartbeat's look for a silent host, over every host row, is a few comparisons a row and
-- not a function call a row (1.4 ms a heartbeat at 100 hosts, 22 ms at 1,000 before): keep it so.
CREATE FUNCTION unitvisor.host_is_overdue(h unitvisor.hosts) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT h.heartbeat_at < now() - make_interval(secs => coalesce(h.dead_after_sec, 60))
       AND (h.state IN ('active', 'draining')
            OR (h.state = 'stopped' AND unitvisor.host_has_open_attempt(h.id)))
$$;

-- A host that may declare others dead and settle their attempts: not fenced (check_fence says that),
-- active or draining, and heard from within its own host_dead_after by the database's clock. One that
-- is itself silent that long may be declared dead by a peer at any moment: it must not be the one
-- deciding about others. declare_dead_hosts and record_outcome ask this one function, in the same
-- transaction (the same now()), so that a host allowed to declare is allowed to settle what it declared.
CREATE FUNCTION unitvisor.host_acts_for_fleet(h unitvisor.hosts) RETURNS boolean
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT h.state IN ('active', 'draining')
       AND h.heartbeat_at >= now() - make_interval(secs => coalesce(h.dead_after_sec, 60))
$$;

-- A host's reading of its own clock, on the database's: an attempt's start is stamped by the database
-- (mark_started's now()) and its end read by the host (systemd's exit time), so a host 30 s behind
-- showed a 5 s run as -25 s. Chosen: every time stored is the database's clock, the one clock all hosts
-- share, and a host's reading is moved by `offset`, the host's clock offset measured when it records
-- (the database's statement_timestamp() minus the host's clock at the call), then kept within
-- [earliest, latest]: no attempt starts before it was claimed or ends before it started, and nothing
-- ends after it is recorded. Chosen over now() at record time, which would stretch a run by however
-- long its daemon was down when it ended (issue 12: systemd's reading is the run's real end). An offset
-- within a second is the measurement's own noise (the trip of the statement), not a clock's: it is
-- not applied, and systemd's microseconds are kept as read. A NULL offset (a 0.5.x daemon, which sends
-- no clock) moves nothing; the bounds alone keep such a duration sane (never negative, never past the
-- recording), if shorter than the run was on a host whose clock is behind.
CREATE FUNCTION unitvisor.host_time_on_db_clock(reading timestamptz, "offset" interval, earliest timestamptz,
                                                latest timestamptz) RETURNS timestamptz
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    -- (greatest and least skip NULLs: a NULL reading must stay NULL, "not read", not become a bound.)
    SELECT CASE WHEN reading IS NOT NULL THEN
        greatest(earliest, least(latest, reading + CASE WHEN abs(extract(epoch FROM "offset")) > 1
                                                       THEN "offset" ELSE interval '0' END)) END
$$;

-- declare_dead_hosts as in 002, deciding from the database's own facts. The declarer has been connected
-- for as long as its registration is old (hosts.started_at); connected_for, the caller's own measure
-- (0.5.x daemons pass it), may only make that shorter. A declarer that does not act for the fleet
-- (host_acts_for_fleet: draining or active, and heard from) declares nothing: it could not settle the
-- attempts of what it declared (record_outcome asks the same).
CREATE FUNCTION unitvisor.declare_dead_hosts(declarer text, declarer_epoch bigint,
                                                        connected_for double precision)
RETURNS TABLE (host_id text, silent_sec double precision, dead_after_sec double precision)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    me unitvisor.hosts;
    connected double precision;
BEGIN
    PERFORM unitvisor.check_fence(declare_dead_hosts.declarer, declare_dead_hosts.declarer_epoch);
    SELECT * INTO me FROM unitvisor.hosts h WHERE h.id = declare_dead_hosts.declarer;
    IF NOT unitvisor.host_acts_for_fleet(me) THEN
        RETURN;
    END IF;
    connected := least(extract(epoch FROM now() - me.started_at)::double precision,
                       coalesce(declare_dead_hosts.connected_for, 0));
    IF NOT pg_try_advisory_xact_lock(hashtextextended('unitvisor-fleet-upkeep', 0)) THEN
        RETURN;
    END IF;
    RETURN QUERY
    UPDATE unitvisor.hosts h SET state = 'dead', epoch = nextval('unitvisor.host_epochs'), dead_at = now(),
        drained_before_death = (h.state = 'draining'),
        dead_reason = format('silent for %s s (its host_dead_after is %s s); declared dead by host %s',
                             round(extract(epoch FROM now() - h.heartbeat_at)::numeric),
                             coalesce(h.dead_after_sec, 60), declare_dead_hosts.declarer)
    WHERE h.id <> declare_dead_hosts.declarer AND unitvisor.host_is_overdue(h)
      AND coalesce(h.dead_after_sec, 60) <= connected
    RETURNING h.id, extract(epoch FROM now() - h.heartbeat_at)::double precision,
              coalesce(h.dead_after_sec, 60);
END $$;

-- Whether the calling host does the fleet's upkeep now: true for the first live host that asks once
-- `every` has passed since the last turn, false for every other. A lease row, not an advisory lock: a
-- transaction-level advisory lock only keeps two passes from overlapping, so 300 daemons would still
-- make 300 passes an interval, one after the other; a session-level one would need a connection held
-- for it (and breaks under a transaction pooler). The row records when the last turn was, so the work
-- is done once an interval whoever asks, and a daemon that died while it had the turn costs nothing:
-- the next interval's turn goes to whoever asks first. SKIP LOCKED: a host that finds another taking the
-- turn right now does not wait for it. Autocommit: the turn is taken even if the upkeep then fails.
CREATE FUNCTION unitvisor.fleet_upkeep_turn(host_id text, host_epoch bigint, every interval) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    me unitvisor.hosts;
BEGIN
    PERFORM unitvisor.check_fence(fleet_upkeep_turn.host_id, fleet_upkeep_turn.host_epoch);
    SELECT * INTO me FROM unitvisor.hosts h WHERE h.id = fleet_upkeep_turn.host_id;
    IF NOT unitvisor.host_acts_for_fleet(me) THEN
        RETURN false;
    END IF;
    UPDATE unitvisor.fleet_upkeep u SET turn_at = now(), turn_host = fleet_upkeep_turn.host_id
    WHERE u.id IN (SELECT v.id FROM unitvisor.fleet_upkeep v
                   WHERE v.turn_at <= now() - fleet_upkeep_turn.every FOR UPDATE SKIP LOCKED);
    RETURN FOUND;
END $$;

-- When a host is late (declare_dead's guards, and a return that is a disruption): its heartbeat older than
-- this many seconds, two of its poll intervals and half its host_dead_after. A SQL function with no SET, so
-- that it is inlined where it is read (a trigger's WHEN clause among them).
CREATE FUNCTION unitvisor.host_late_sec(h unitvisor.hosts) RETURNS double precision
LANGUAGE sql IMMUTABLE AS $$
    SELECT greatest(2 * coalesce(h.poll_interval_sec, 10), coalesce(h.dead_after_sec, 60) / 2)
$$;
REVOKE EXECUTE ON FUNCTION unitvisor.host_late_sec(unitvisor.hosts) FROM PUBLIC;

-- declare_dead_hosts as in 013 (the same lock, the same hosts, the same reasons), with the guards that
-- tell a silent host from a database or a fleet that is behind (docs/fleet.md, Dead hosts). A host is
-- late when its heartbeat is older than two of its poll intervals and half its host_dead_after (by the
-- database's clock): a loop that keeps time, or whose thread sends the heartbeat aside, is never that
-- late (at most 1.5 poll intervals and a statement), and half of host_dead_after keeps the fast test
-- settings (1 s polls) from calling a loaded machine's ordinary delays late.
-- * the declarer's own heartbeat is late: the database, or this daemon, is behind; a host it would
--   declare may be as slow as itself;
-- * most of the other hosts are late: more than half, and at least two, of the active and draining
--   hosts that are neither the declarer nor overdue: the database is behind, not the silent hosts;
-- * most of the fleet is silent at once (036): more than max_hosts, and more than half of the other
--   hosts, are overdue: the database or its network is more likely behind than that many hosts down;
-- * at most max_hosts are declared at once, the longest silent first; the rest wait for the next pass.
-- * after a fleet-wide hold, a grace (036): a host is declared once silent for its host_dead_after
--   since the later of its heartbeat and the last hold ('fleet-recovering' until then);
-- A host the operator confirmed down (confirm_host_down) is held by neither fleet-wide guard nor the
-- grace, and comes first under the cap; sql/migrations/036_fleet_silent.sql says why.
-- Held declarations are said in held (how many) and held_why ('declarer-late', 'fleet-late',
-- 'fleet-silent', 'fleet-recovering', 'cap')
-- with held_detail, on every row; a pass that declares nobody but held some returns one row whose
-- host_id is NULL. The caller settles the declared hosts' open attempts in the same transaction.
CREATE FUNCTION unitvisor.declare_dead(declarer text, declarer_epoch bigint,
                                                  connected_for double precision, max_hosts integer)
RETURNS TABLE (host_id text, silent_sec double precision, dead_after_sec double precision,
               held integer, held_why text, held_detail text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    me unitvisor.hosts;
    connected double precision;
    own_age double precision;
    overdue integer;
    confirmed integer;
    others integer;
    late integer;
    fleet_why text;
    fleet_detail text;
    held_at timestamptz;
    in_grace integer;
BEGIN
    PERFORM unitvisor.check_fence(declare_dead.declarer, declare_dead.declarer_epoch);
    SELECT * INTO me FROM unitvisor.hosts h WHERE h.id = declare_dead.declarer;
    IF NOT unitvisor.host_acts_for_fleet(me) THEN
        RETURN;
    END IF;
    connected := least(extract(epoch FROM now() - me.started_at)::double precision,
                       coalesce(declare_dead.connected_for, 0));
    -- The lock declare_dead_hosts takes: a 0.7 daemon's declaration and this one never overlap.
    IF NOT pg_try_advisory_xact_lock(hashtextextended('unitvisor-fleet-upkeep', 0)) THEN
        RETURN;
    END IF;
    -- The fleet's last disruption: its last hold, or a silent host heard from again (returned_late_at).
    SELECT greatest(u.fleet_held_at, (SELECT max(h.returned_late_at) FROM unitvisor.hosts h))
    INTO held_at FROM unitvisor.fleet_upkeep u;
    -- The silent hosts; those confirmed down; those within their host_dead_after of the last hold.
    SELECT count(*), count(*) FILTER (WHERE h.down_confirmed_at IS NOT NULL),
           count(*) FILTER (WHERE h.down_confirmed_at IS NULL
                              AND held_at > now() - make_interval(secs => coalesce(h.dead_after_sec, 60)))
    INTO overdue, confirmed, in_grace
    FROM unitvisor.hosts h
    WHERE h.id <> declare_dead.declarer AND unitvisor.host_is_overdue(h)
      AND coalesce(h.dead_after_sec, 60) <= connected;
    IF overdue = 0 THEN
        RETURN;
    END IF;
    own_age := extract(epoch FROM clock_timestamp() - me.heartbeat_at)::double precision;
    IF own_age > unitvisor.host_late_sec(me) THEN
        UPDATE unitvisor.fleet_upkeep u SET fleet_held_at = now();  -- the database is behind: a disruption
        RETURN QUERY SELECT NULL::text, NULL::double precision, NULL::double precision, overdue, 'declarer-late',
            format('this host''s own heartbeat is %s s old (over two of its poll intervals and half its '
                   'host_dead_after): the database or this daemon is behind', round(own_age::numeric));
        RETURN;
    END IF;
    SELECT count(*), count(*) FILTER (WHERE h.heartbeat_at < now() - make_interval(secs => unitvisor.host_late_sec(h)))
    INTO others, late
    FROM unitvisor.hosts h
    WHERE h.id <> declare_dead.declarer AND h.state IN ('active', 'draining') AND NOT unitvisor.host_is_overdue(h);
    IF late * 2 > others AND late >= 2 THEN
        fleet_why := 'fleet-late';
        fleet_detail := format('%s of the %s other live hosts are late too: the database is behind, not the %s '
                               'silent host(s)', late, others, overdue - confirmed);
    ELSIF overdue > declare_dead.max_hosts AND overdue > others THEN
        fleet_why := 'fleet-silent';
        fleet_detail := format('%s of the %s other hosts are silent at once, more than half of them and more than '
                               '[fleet] max_dead_per_pass (%s): the database or its network is more likely behind '
                               'than that many hosts down; `unitvisor hosts confirm-down HOST` has a host that is '
                               'really down declared', overdue - confirmed, overdue + others, declare_dead.max_hosts);
    END IF;
    IF fleet_why IS NOT NULL THEN
        -- (held_at keeps the previous hold: this pass's own reason, fleet_why, comes before the grace's)
        UPDATE unitvisor.fleet_upkeep u SET fleet_held_at = now();
    END IF;
    RETURN QUERY
    WITH chosen AS (
        SELECT h.id FROM unitvisor.hosts h
        WHERE h.id <> declare_dead.declarer AND unitvisor.host_is_overdue(h)
          AND coalesce(h.dead_after_sec, 60) <= connected
          AND (h.down_confirmed_at IS NOT NULL
               OR (fleet_why IS NULL AND (held_at IS NULL
                                          OR held_at <= now() - make_interval(secs => coalesce(h.dead_after_sec, 60)))))
        ORDER BY h.down_confirmed_at IS NULL, h.heartbeat_at, h.id LIMIT greatest(declare_dead.max_hosts, 0)
        FOR UPDATE
    ),
    declared AS (
        UPDATE unitvisor.hosts h SET state = 'dead', epoch = nextval('unitvisor.host_epochs'), dead_at = now(),
            drained_before_death = (h.state = 'draining'),
            dead_reason = format('silent for %s s (its host_dead_after is %s s); declared dead by host %s%s',
                                 round(extract(epoch FROM now() - h.heartbeat_at)::numeric),
                                 coalesce(h.dead_after_sec, 60), declare_dead.declarer,
                                 CASE WHEN h.down_confirmed_at IS NOT NULL
                                      THEN format(', confirmed down by %s', h.down_confirmed_by) ELSE '' END),
            down_confirmed_at = NULL, down_confirmed_by = NULL
        FROM chosen WHERE h.id = chosen.id
        RETURNING h.id, extract(epoch FROM now() - h.heartbeat_at)::double precision AS silent,
                  coalesce(h.dead_after_sec, 60)::double precision AS dead_after
    ),
    summary AS (
        SELECT greatest(overdue - count(*), 0)::integer AS held,
               -- the fleet-wide guard when it held any host nobody confirmed, else the cap
               CASE WHEN fleet_why IS NOT NULL AND overdue > confirmed THEN fleet_why
                    WHEN in_grace > 0 THEN 'fleet-recovering'
                    WHEN overdue > count(*) THEN 'cap' END AS why
        FROM declared
    )
    SELECT d.id, d.silent, d.dead_after, s.held, s.why,
           CASE s.why WHEN 'cap' THEN format('%s more silent host(s) wait for the next pass ([fleet] '
                                             'max_dead_per_pass is %s)', s.held, declare_dead.max_hosts)
                      WHEN 'fleet-recovering' THEN format(
                          '%s silent host(s) get their host_dead_after again from the fleet''s last disruption (a '
                          'fleet-wide hold, or a silent host heard from again, %s s ago): hosts come back from one '
                          'over some time',
                          in_grace, round(extract(epoch FROM now() - held_at)::numeric))
                      ELSE fleet_detail END
    FROM summary s LEFT JOIN declared d ON true;
END $$;

-- A host heard from is not down: its confirmation ends. A trigger with a WHEN clause, so that the
-- heartbeat of a host that nobody confirmed (every heartbeat, nearly always) calls no function.
CREATE FUNCTION unitvisor.end_down_confirmation() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    NEW.down_confirmed_at := NULL;
    NEW.down_confirmed_by := NULL;
    RETURN NEW;
END $$;

CREATE TRIGGER hosts_heard_from BEFORE UPDATE OF heartbeat_at ON unitvisor.hosts
    FOR EACH ROW WHEN (OLD.down_confirmed_at IS NOT NULL AND NEW.heartbeat_at > OLD.heartbeat_at)
    EXECUTE FUNCTION unitvisor.end_down_confirmation();

-- A late host heard from again before anyone declared it (its heartbeat, or its daemon registering
-- again) proves that silence is not death just now: returned_late_at, which declare_dead takes as a
-- disruption, as it does its own holds. Late as declare_dead says (older than two of its poll intervals
-- and half its host_dead_after), not only overdue (044): a storm of reconnections lets hosts back one at
-- a time, after spells of every length, and those that got through are the evidence that the silent ones
-- may not. Written on the host's own row by the update that carries the
-- heartbeat, so that a fleet coming back at once does not queue on one shared row. A WHEN clause, so
-- that a heartbeat on time (every heartbeat, nearly always) calls no function.
CREATE FUNCTION unitvisor.note_late_return() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    NEW.returned_late_at := NEW.heartbeat_at;
    RETURN NEW;
END $$;

CREATE TRIGGER hosts_heard_late BEFORE UPDATE OF heartbeat_at ON unitvisor.hosts
    FOR EACH ROW WHEN (OLD.state IN ('active', 'draining') AND NEW.state IN ('active', 'draining')
                       AND OLD.heartbeat_at < NEW.heartbeat_at - make_interval(secs => unitvisor.host_late_sec(OLD)))
    EXECUTE FUNCTION unitvisor.note_late_return();

-- The operator's word that a host is down (its machine is off, or gone): it is declared dead once it
-- is overdue, whatever the fleet-wide guards say. Returns the host's state; NULL when there is no such
-- host. A dead host needs none (it is declared already): its state is returned and nothing changes.
-- Granted to no role: the database owner's (as hosts add and hosts forget are).
CREATE FUNCTION unitvisor.confirm_host_down(host_id text) RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    found_state text;
BEGIN
    UPDATE unitvisor.hosts h SET down_confirmed_at = now(), down_confirmed_by = session_user
    WHERE h.id = confirm_host_down.host_id AND h.state <> 'dead';
    SELECT h.state INTO found_state FROM unitvisor.hosts h WHERE h.id = confirm_host_down.host_id;
    RETURN found_state;
END $$;

-- The heartbeat alone, as heartbeat (012) renews it: the same row, the same epoch check (a host whose
-- epoch is over renews nothing and gets NULL), the same caller check. A daemon sends it on a connection
-- of its own when its loop has not sent its probe in time (busy with a claim, a reconcile pass or the
-- upkeep on a slow database), so that its own work never makes it look dead (issue 23).
CREATE FUNCTION unitvisor.renew_heartbeat(host_id text, host_epoch bigint) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    renewed text;
BEGIN
    PERFORM unitvisor.require_host(renew_heartbeat.host_id);
    UPDATE unitvisor.hosts h SET heartbeat_at = now()
    WHERE h.id = renew_heartbeat.host_id AND h.epoch = renew_heartbeat.host_epoch AND h.state <> 'dead'
    RETURNING h.state INTO renewed;
    RETURN renewed;
END $$;

-- == functions: which host may run which run ========================================================

-- A host's labels while its current registration holds, '{}' otherwise (none registered, or registered
-- by its previous daemon). Inlined (sql, no SET): host_refusal calls it per host.
CREATE FUNCTION unitvisor.host_labels(h unitvisor.hosts) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN h.labels_at >= h.started_at THEN coalesce(h.labels, '{}'::jsonb) ELSE '{}'::jsonb END
$$;

-- Whether a run's retry avoids the host of a last attempt that ended with `outcome` (avoid_failed_host:
-- NULL for lost only, true for every failure, false never).
CREATE FUNCTION unitvisor.avoids_host(avoid_failed_host boolean, outcome text) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN avoid_failed_host IS NULL THEN outcome = 'lost'
                WHEN avoid_failed_host THEN outcome NOT IN ('success', 'cancelled')
                ELSE false END
$$;

-- How long the host a retry avoids passes it over, after the retry is due, while another live host
-- accepts it: longer than two poll intervals (every other live host has had its chance to claim it,
-- and a woken one claims at once), short enough that a run whose other hosts are full loses a minute.
CREATE FUNCTION unitvisor.avoid_failed_host_grace() RETURNS interval
LANGUAGE sql IMMUTABLE AS $$ SELECT interval '60 seconds' $$;

-- As in 003, with one more reason, last so that a run a host would refuse anyway names that first: a
-- host that claims nothing under pressure. Still the one function the claim, the probe (whose
-- `claimable` is then false, so a stopped host is not woken to claim nothing) and the explanation of
-- a waiting run ask, so the database refuses what the daemon would not claim, and a waiting run
-- says "no live host accepts it: claims nothing under memory pressure (web-1)". The words name the
-- resource and no figure: explain_waiting writes an event whenever a reason changes.
-- A report older than the host's registration (hosts.started_at, stamped at every registration) is
-- the previous daemon's: void, so that a daemon that died stopped, or one replaced by a 0.6.0 daemon
-- that reports nothing, does not keep its host closed.
-- Since 033 also the run's host_labels (migration 033 says why the failed host a retry avoids is not here).
-- PL/pgSQL since 037, as concurrency_blocker, key_blocker_text and limit_text below: planned once a
-- session, where a SQL function not inlined was planned again at every call from a heartbeat.
CREATE FUNCTION unitvisor.host_refusal(h unitvisor.hosts, r unitvisor.runs) RETURNS text
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN CASE
        WHEN r.host_pin IS NOT NULL AND r.host_pin <> h.id THEN 'pinned to host ' || r.host_pin
        WHEN NOT h.can_start THEN 'cannot start units (' || coalesce(h.cannot_start_reason, 'unknown') || ')'
        -- Placement (033): every one of the run's host_labels among the host's labels, one containment
        -- on the two rows already read; the words name the pairs it lacks.
        WHEN NOT unitvisor.host_labels(h) @> coalesce(r.host_labels, '{}')
            THEN 'has no label ' || (SELECT string_agg(l.key || '=' || l.value, ', ' ORDER BY l.key)
                                     FROM jsonb_each_text(r.host_labels) AS l(key, value)
                                     WHERE NOT unitvisor.host_labels(h) @> jsonb_build_object(l.key, l.value))
        WHEN NOT EXISTS (SELECT 1 FROM unnest(h.executable_patterns) AS p(pattern) WHERE r.argv[1] ~ p.pattern)
            THEN 'executable ' || r.argv[1] || ' is not allowed'
        WHEN r.run_user IS NOT NULL AND r.run_user <> h.run_user AND NOT r.run_user = ANY (h.allowed_users)
            THEN 'user ' || r.run_user || ' is not allowed'
        WHEN unitvisor.refused_environment_name(h, r) IS NOT NULL
            THEN 'environment name ' || unitvisor.refused_environment_name(h, r) || ' is not allowed'
        WHEN r.memory_max IS NOT NULL AND h.memory_budget IS NOT NULL AND r.memory_max > h.memory_budget
            THEN 'memory_max ' || r.memory_max || ' bytes is over the memory budget'
        WHEN h.pressure_state = 'stopped' AND h.pressure_at >= h.started_at
            THEN 'claims nothing under ' || coalesce(h.pressure_resource, 'some') || ' pressure'
    END;
END $$;

-- As in 003, the first of r's environment names that host h refuses, or NULL, by the rule above. Still
-- the one function host_refusal asks (the claim, the probe and the explanation of a waiting run).
CREATE FUNCTION unitvisor.refused_environment_name(h unitvisor.hosts, r unitvisor.runs) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT min(e.name)
    FROM jsonb_object_keys(CASE WHEN jsonb_typeof(r.environment) = 'object' THEN r.environment ELSE '{}' END)
        AS e(name)
    WHERE CASE WHEN h.environment_patterns IS NULL
        THEN e.name ~ ANY (h.environment_denied) AND NOT e.name ~ ANY (coalesce(h.environment_allowed, '{}'))
        ELSE NOT (e.name = ANY (coalesce(h.environment_names, '{}'))
                  OR (e.name ~ ANY (h.environment_patterns)
                      AND NOT e.name ~ ANY (coalesce(h.environment_denied, '{}'))))
    END
$$;

-- fleet_refusal as in 002, asking each live host once (002 asked each twice: once whether it accepts
-- the run, once why not), and for a pinned run only the host it is pinned to (any other refuses it
-- anyway). The words are 002's.
CREATE FUNCTION unitvisor.fleet_refusal(r unitvisor.runs) RETURNS text
LANGUAGE sql STABLE AS $$
    WITH live AS MATERIALIZED (
        SELECT h.id, unitvisor.host_refusal(h, r) AS reason
        FROM unitvisor.hosts h
        WHERE unitvisor.host_is_live(h) AND (r.host_pin IS NULL OR h.id = r.host_pin)
    )
    SELECT CASE
        WHEN EXISTS (SELECT 1 FROM live WHERE live.reason IS NULL) THEN NULL
        WHEN r.host_pin IS NOT NULL THEN (
            SELECT coalesce(
                (SELECT CASE
                    WHEN p.state = 'dead' THEN format('pinned to host %s, which is dead (%s)', p.id, p.dead_reason)
                    WHEN p.state <> 'active' THEN format('pinned to host %s, which is %s', p.id, p.state)
                    WHEN NOT unitvisor.host_is_live(p) THEN format(
                        'pinned to host %s, which has been silent since %s', p.id,
                        to_char(p.heartbeat_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS "UTC"'))
                    ELSE format('pinned to host %s, which does not accept it: %s', p.id,
                                (SELECT live.reason FROM live WHERE live.id = p.id))
                 END FROM unitvisor.hosts p WHERE p.id = r.host_pin),
                format('pinned to host %s, which is not known (see unitvisor hosts)', r.host_pin)))
        WHEN NOT EXISTS (SELECT 1 FROM live)
            THEN 'no live host (every host is dead, stopped, draining or silent)'
        ELSE 'no live host accepts it: ' || (
            SELECT string_agg(reasons.reason, '; ' ORDER BY reasons.reason) FROM (
                SELECT format('%s (%s)', live.reason, string_agg(live.id, ', ' ORDER BY live.id)) AS reason
                FROM live GROUP BY live.reason) reasons)
    END
$$;

-- The queued runs among run_ids that no live host accepts now, each with fleet_refusal's reason; a run
-- some live host accepts, not queued, unknown or not visible to the caller is left out.
CREATE FUNCTION unitvisor.refusals_now(run_ids uuid[])
RETURNS TABLE (run_id uuid, reason text)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT w.id, w.reason FROM (
        SELECT r.id, unitvisor.fleet_refusal(r) AS reason
        FROM unitvisor.runs r
        WHERE r.id = ANY(refusals_now.run_ids[1:1000]) AND r.state = 'queued'
          AND (pg_has_role(session_user, 'unitvisor_admin', 'MEMBER')
               OR pg_has_role(session_user, 'unitvisor_submitter', 'MEMBER')
               OR unitvisor.host_may_see(r.host_pin, r.id, unitvisor.my_host_id()))
    ) w
    WHERE w.reason IS NOT NULL
$$;

-- Whether another live host that can start units would also run r: only such runs are shared out.
CREATE FUNCTION unitvisor.also_accepted(me unitvisor.hosts, r unitvisor.runs) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM unitvisor.hosts h
                   WHERE h.id <> me.id AND h.can_start AND unitvisor.host_is_live(h)
                     AND unitvisor.host_refusal(h, r) IS NULL)
$$;

-- concurrency_blocker as in 006, in submission order by seq: once as many runs of its key are live as
-- the smallest concurrency_limit among r's and theirs (032), the live run with that limit (the earliest
-- submitted of them), else the queued run of its key submitted just before it. Runs numbered NULL (submitted
-- before this migration) come before every numbered run, and among themselves by created_at, then id.
-- PL/pgSQL since 037 (host_refusal).
CREATE FUNCTION unitvisor.concurrency_blocker(r unitvisor.runs) RETURNS uuid
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF r.concurrency_key IS NULL THEN
        RETURN NULL;
    END IF;
    RETURN coalesce(
        (SELECT l.id FROM (
             SELECT k.id, k.seq, k.concurrency_limit, count(*) OVER () AS live, min(k.concurrency_limit) OVER () AS tightest
             FROM unitvisor.runs k
             WHERE k.concurrency_key = r.concurrency_key AND k.state IN ('starting', 'running') AND k.id <> r.id) l
         WHERE l.live >= least(r.concurrency_limit, l.tightest)
         ORDER BY l.concurrency_limit, l.seq NULLS FIRST, l.id LIMIT 1),
        (SELECT k.id FROM unitvisor.runs k
         WHERE k.concurrency_key = r.concurrency_key AND k.state = 'queued' AND k.seq < r.seq
         ORDER BY k.seq DESC LIMIT 1),
        (SELECT k.id FROM unitvisor.runs k
         WHERE k.concurrency_key = r.concurrency_key AND k.state = 'queued' AND k.seq IS NULL AND k.id <> r.id
           AND (r.seq IS NOT NULL OR (k.created_at, k.id) < (r.created_at, r.id))
         ORDER BY k.created_at DESC, k.id DESC LIMIT 1));
END $$;

-- concurrency_blocker's run in words, for a wait reason (NULL: r waits for no run of its key): its
-- state, a held run's hold (a run behind a held head waits for its release), and with a limit above
-- one how many of the key's runs are live. PL/pgSQL since 037 (host_refusal).
CREATE FUNCTION unitvisor.key_blocker_text(r unitvisor.runs) RETURNS text
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF r.concurrency_key IS NULL THEN
        RETURN NULL;
    END IF;
    RETURN (SELECT format('run %s (%s) with the same concurrency key', b.id,
                      CASE WHEN b.state = 'queued' AND b.held_at IS NOT NULL THEN 'queued, held by ' || b.held_by
                           ELSE b.state END)
               || CASE WHEN b.state IN ('starting', 'running') AND least(r.concurrency_limit, b.concurrency_limit) > 1
                       THEN format(', %s of %s live',
                                   (SELECT count(*) FROM unitvisor.runs k
                                    WHERE k.concurrency_key = r.concurrency_key AND k.state IN ('starting', 'running')),
                                   least(r.concurrency_limit, b.concurrency_limit))
                       ELSE '' END
        FROM unitvisor.runs b WHERE b.id = unitvisor.concurrency_blocker(r));
END $$;

-- Every check of a named limit's arguments (set_limit): the first refused, in a message that names it;
-- NULL when all pass.
CREATE FUNCTION unitvisor.limit_argument_problem(name text, selector jsonb, max_live integer) RETURNS text
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE
        WHEN name IS NULL OR name !~ '^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$' THEN
            'name: must be 1 to 63 letters, digits, ".", "_" and "-", starting and ending with a letter or digit'
        WHEN selector IS NULL OR NOT unitvisor.labels_are_valid(selector) THEN
            'selector: must be a JSON object of labels as a run''s (at most 64 key -> string pairs); '
            || 'a run falls under the limit when its labels hold every pair ({}: every run)'
        WHEN max_live IS NULL OR max_live NOT BETWEEN 0 AND 1000000 THEN
            format('max_live: %s is out of range (0 to 1000000; 0 lets no run of the limit start)',
                   coalesce(max_live::text, 'NULL'))
        END
$$;

-- Create or change a named limit: at most max_live runs whose labels hold every pair of selector are
-- live at once in the fleet. A limit lowered below its live count stops nothing: its runs finish, and
-- no new one starts until fewer than max_live are live. created: false when the limit existed (changed).
CREATE FUNCTION unitvisor.set_limit(name text, selector jsonb, max_live integer) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    problem text := unitvisor.limit_argument_problem(set_limit.name, set_limit.selector, set_limit.max_live);
    created boolean;
BEGIN
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION '%', problem
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'limits',
                  CONSTRAINT = 'limits_' || split_part(problem, ':', 1) || '_valid';
    END IF;
    INSERT INTO unitvisor.limits AS l (name, selector, max_live)
    VALUES (set_limit.name, set_limit.selector, set_limit.max_live)
    ON CONFLICT ON CONSTRAINT limits_pkey DO UPDATE
        SET selector = excluded.selector, max_live = excluded.max_live, set_at = now(), set_by = session_user
    RETURNING (l.xmax::text = '0') INTO created;
    RETURN created;
END $$;

-- Drop a named limit: its runs are held back by it no more. False: there was no such limit.
CREATE FUNCTION unitvisor.drop_limit(name text) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    DELETE FROM unitvisor.limits l WHERE l.name = drop_limit.name;
    RETURN FOUND;
END $$;

-- Every named limit with its live runs now, by name: the CLI's `unitvisor limits` and the daemon's
-- metrics. Counted over every run (a host's role sees only some: SECURITY DEFINER), and only the count.
CREATE FUNCTION unitvisor.limit_status()
RETURNS TABLE (name text, selector jsonb, max_live integer, live bigint, set_at timestamptz, set_by text)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT l.name, l.selector, l.max_live,
           (SELECT count(*) FROM unitvisor.runs x WHERE x.state IN ('starting', 'running') AND x.labels @> l.selector),
           l.set_at, l.set_by
    FROM unitvisor.limits l ORDER BY l.name
$$;

-- The first named limit (by name) that holds r back now, in words ("limit batch: 20 of 20 live"), or
-- NULL: for wait reasons (explain_waiting) and an expired run's (waited_for). PL/pgSQL since 037.
CREATE FUNCTION unitvisor.limit_text(r unitvisor.runs) RETURNS text
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN (SELECT format('limit %s: %s of %s live', s.name, s.live, s.max_live)
        FROM (SELECT l.name, l.max_live,
                     (SELECT count(*) FROM unitvisor.runs x
                      WHERE x.state IN ('starting', 'running') AND x.labels @> l.selector AND x.id <> r.id) AS live
              FROM unitvisor.limits l WHERE r.labels @> l.selector) s
        WHERE s.live >= s.max_live ORDER BY s.name LIMIT 1);
END $$;

-- The claim's decision on the named limits r falls under: NULL when each has room for it, else the name
-- of the first (by name) that has none, or whose lock another claim holds (that claim decides for the
-- limit now: this one passes r over). Each limit's transaction-level advisory lock, then its count from
-- a snapshot taken after it (READ COMMITTED, a VOLATILE function: each statement sees every claim of
-- the limit that committed, and none is in progress), as the claim does for a concurrency key (006).
-- The locks are tried in name order and never waited for, so two claims cannot deadlock on them. Cost:
-- a look at the limits table, and per limit of the run at most max_live index entries of live runs,
-- for a run about to be claimed only; nothing when no limit matches.
CREATE FUNCTION unitvisor.claim_limits(r unitvisor.runs) RETURNS text
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    lim record;
BEGIN
    FOR lim IN SELECT l.name, l.selector, l.max_live FROM unitvisor.limits l
               WHERE r.labels @> l.selector ORDER BY l.name LOOP
        IF NOT pg_try_advisory_xact_lock(hashtextextended('unitvisor-limit:' || lim.name, 0)) THEN
            RETURN lim.name;
        END IF;
        IF (SELECT count(*) FROM (SELECT 1 FROM unitvisor.runs x
                                  WHERE x.state IN ('starting', 'running') AND x.labels @> lim.selector
                                  LIMIT lim.max_live) c) >= lim.max_live THEN
            RETURN lim.name;
        END IF;
    END LOOP;
    RETURN NULL;
END $$;

-- The kind of a run: what host_refusal reads of it (besides the host), so that one answer holds for
-- every run of a kind (since 033 its host_labels, when it has some). Environment names only (sorted), never their values, which may be secrets.
CREATE FUNCTION unitvisor.run_kind(r unitvisor.runs) RETURNS text
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT md5((jsonb_build_array(
        r.argv[1], r.run_user, r.memory_max, r.host_pin,
        CASE WHEN jsonb_typeof(r.environment) = 'object'
             THEN (SELECT coalesce(jsonb_agg(e.name ORDER BY e.name), '[]') FROM jsonb_object_keys(r.environment) AS e(name))
             ELSE r.environment END)
        -- host_labels (033) only when the run has some: a run without keeps the kind it had before.
        || CASE WHEN coalesce(r.host_labels, '{}') = '{}' THEN '[]'::jsonb ELSE jsonb_build_array(r.host_labels) END)::text)
$$;

-- The queued run of `key` that concurrency_blocker puts first (numbered NULL first, by created_at and
-- id; then by seq), or NULL when none is queued. Whether it may start (nothing of its key starting or
-- running) is concurrency_blocker's to say.
CREATE FUNCTION unitvisor.key_head(key text) RETURNS unitvisor.runs
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT coalesce(
        (SELECT r FROM unitvisor.runs r
         WHERE r.concurrency_key = key AND r.state = 'queued' AND r.seq IS NULL
         ORDER BY r.created_at, r.id LIMIT 1),
        (SELECT r FROM unitvisor.runs r
         WHERE r.concurrency_key = key AND r.state = 'queued' AND r.seq IS NOT NULL
         ORDER BY r.seq LIMIT 1))
$$;

-- The available jobs of concurrency keys that a claim may look at: per key with a job waiting, the job of
-- its head when nothing of the key is starting or running; and the jobs of a key that has no queued run
-- at all (stale: their runs moved on), at most 10 a key, so that a claim discards them. Every other job of
-- a key waits behind its head: concurrency_blocker says so for each, and no claim need look at them.
-- Due or not, overdue or not: the claim's query decides that, as for any job. One skip-scan probe and a
-- few index look-ups per key, for at most `max_keys` keys: past that (many keys waiting, say one per
-- run of a burst), NULL, and the claim asks concurrency_blocker of each keyed job it fetches, as 013
-- did, which costs what it takes, not the number of keys.
CREATE FUNCTION unitvisor.key_head_jobs(max_keys integer DEFAULT 64) RETURNS bigint[]
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    key text;
    head unitvisor.runs;
    ids bigint[] := '{}';
    keys integer := 0;
BEGIN
    SELECT j.concurrency_key INTO key FROM unitvisor.spawn_jobs j
    WHERE j.state = 'available' AND j.concurrency_key IS NOT NULL ORDER BY j.concurrency_key LIMIT 1;
    WHILE key IS NOT NULL LOOP
        keys := keys + 1;
        IF keys > max_keys THEN
            RETURN NULL;
        END IF;
        head := unitvisor.key_head(key);
        IF head.id IS NULL THEN
            ids := ids || ARRAY(SELECT j.id FROM unitvisor.spawn_jobs j
                                WHERE j.state = 'available' AND j.concurrency_key = key LIMIT 10);
        ELSIF unitvisor.concurrency_blocker(head) IS NULL THEN
            ids := ids || ARRAY(SELECT j.id FROM unitvisor.spawn_jobs j
                                WHERE j.run_id = head.id AND j.state = 'available');
        END IF;
        SELECT j.concurrency_key INTO key FROM unitvisor.spawn_jobs j
        WHERE j.state = 'available' AND j.concurrency_key > key ORDER BY j.concurrency_key LIMIT 1;
        IF NOT FOUND THEN
            key := NULL;
        END IF;
    END LOOP;
    RETURN ids;
END $$;

-- Whether a claim by `me` now could take a run, or discard a stale job: the heartbeat's claimable (see the
-- head of 020). It may say true where the claim then takes nothing (the fair share holds a burst's run for
-- another host within spread_grace, the memory budget is used up, another host took it first), never false
-- where the claim would take one, except for a keyed job left by a run that moved on while its key still
-- has queued runs (no claim looks at it; the run it belongs to is not queued), and (047) a keyless job due
-- when it was made and younger than `left_to_woken`: its submit's NOTIFY named the hosts to take it.
CREATE FUNCTION unitvisor.host_has_work(me unitvisor.hosts, left_to_woken interval DEFAULT '0')
RETURNS boolean
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    this_kind text;
    this_key text;
    head unitvisor.runs;
    keys integer := 0;
BEGIN
    IF me.state <> 'active' OR NOT me.can_start
            OR (SELECT count(*) FROM unitvisor.attempts a WHERE a.host_id = me.id AND a.outcome IS NULL)
               >= me.max_runs THEN
        RETURN false;
    END IF;
    -- Keyless runs: one kind at a time (a skip scan over spawn_jobs_kind_idx).
    SELECT j.kind INTO this_kind FROM unitvisor.spawn_jobs j
    WHERE j.state = 'available' AND j.concurrency_key IS NULL ORDER BY j.kind LIMIT 1;
    WHILE this_kind IS NOT NULL LOOP
        -- The oldest job of the kind stands for all of them before host_refusal (the kind is what it reads).
        SELECT r.* INTO head FROM unitvisor.spawn_jobs j JOIN unitvisor.runs r ON r.id = j.run_id
        WHERE j.state = 'available' AND j.concurrency_key IS NULL AND j.kind = this_kind
        ORDER BY j.scheduled_at LIMIT 1;
        IF head.state <> 'queued' THEN
            RETURN true;  -- a stale job: the claim discards it
        END IF;
        IF unitvisor.host_refusal(me, head) IS NULL AND EXISTS (
                SELECT 1 FROM unitvisor.spawn_jobs j JOIN unitvisor.runs r ON r.id = j.run_id
                WHERE j.state = 'available' AND j.concurrency_key IS NULL AND j.kind = this_kind
                  AND j.scheduled_at <= now()
                  -- 047: not a job due when it was made, younger than left_to_woken (its NOTIFY woke hosts)
                  AND (j.scheduled_at > j.created_at OR j.scheduled_at <= now() - host_has_work.left_to_woken)
                  AND (r.state <> 'queued' OR r.start_deadline IS NULL OR NOT unitvisor.is_overdue(r))) THEN
            RETURN true;
        END IF;
        SELECT j.kind INTO this_kind FROM unitvisor.spawn_jobs j
        WHERE j.state = 'available' AND j.concurrency_key IS NULL AND j.kind > this_kind
        ORDER BY j.kind LIMIT 1;
        IF NOT FOUND THEN
            this_kind := NULL;
        END IF;
    END LOOP;
    -- Keyed runs: the head of each key, when it may start (key_head_jobs), due, not overdue, accepted;
    -- for at most 64 keys: past them, "maybe", and the claim decides (as before 020), so that a fleet
    -- running thousands of keys at once does not pay a probe per key on every heartbeat.
    SELECT j.concurrency_key INTO this_key FROM unitvisor.spawn_jobs j
    WHERE j.state = 'available' AND j.concurrency_key IS NOT NULL ORDER BY j.concurrency_key LIMIT 1;
    WHILE this_key IS NOT NULL LOOP
        keys := keys + 1;
        IF keys > 64 THEN
            RETURN true;
        END IF;
        head := unitvisor.key_head(this_key);
        IF head.id IS NULL THEN
            RETURN true;  -- stale jobs only: the claim discards them
        END IF;
        IF unitvisor.concurrency_blocker(head) IS NULL
                AND EXISTS (SELECT 1 FROM unitvisor.spawn_jobs j
                            WHERE j.run_id = head.id AND j.state = 'available' AND j.scheduled_at <= now())
                AND (head.start_deadline IS NULL OR NOT unitvisor.is_overdue(head))
                AND unitvisor.host_refusal(me, head) IS NULL THEN
            RETURN true;
        END IF;
        SELECT j.concurrency_key INTO this_key FROM unitvisor.spawn_jobs j
        WHERE j.state = 'available' AND j.concurrency_key > this_key ORDER BY j.concurrency_key LIMIT 1;
        IF NOT FOUND THEN
            this_key := NULL;
        END IF;
    END LOOP;
    RETURN false;
END $$;

-- Whether r is past its start deadline without ever having started (no attempt of it recorded a
-- start; one that failed to start, or was refused, did not). A run that started once is never expired:
-- its retries go on as its max_attempts says.
CREATE FUNCTION unitvisor.is_overdue(r unitvisor.runs) RETURNS boolean
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT r.state = 'queued' AND r.start_deadline <= now()
       AND NOT EXISTS (SELECT 1 FROM unitvisor.attempts a WHERE a.run_id = r.id AND a.started_at IS NOT NULL)
$$;

-- What the waiting runs' reasons are read from, but the clock (see above). One walk of the host rows: made
-- by the daemon with the upkeep's turn, once a poll interval, and only while runs wait.
CREATE FUNCTION unitvisor.wait_mark() RETURNS text
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN format('%s/%s/%s', unitvisor.queue_mark(),
                  (SELECT hashtextextended(string_agg(l::text, ',' ORDER BY l.name), 0) FROM unitvisor.limits l),
                  (SELECT hashtextextended(string_agg(
                              row(h.id, unitvisor.host_is_live(h), h.dead_reason,
                                  CASE WHEN NOT unitvisor.host_is_live(h) THEN h.heartbeat_at END,
                                  unitvisor.host_refusal_inputs(h))::text, ',' ORDER BY h.id), 0)
                   FROM unitvisor.hosts h));
END $$;

-- explain_waiting as in 012 (the same reasons, events and result; since 032 the key's blocker in
-- key_blocker_text's words, and a full named limit's, limit_text), with three changes:
-- * fleet_refusal is computed once per kind of run, not once per run: two runs with the same argv[0],
--   user, environment, memory_max and pin are refused by the same hosts for the same reasons
--   (host_refusal reads nothing else of a run). 1,000 runs of one rollout cost one fleet_refusal.
-- * A pass is bounded by its cost, not only by its runs: it takes the due jobs in order from where the
--   last pass stopped (fleet_upkeep.explained_*), at most max_runs of them, and stops before the kind
--   that would take it over REFUSALS_PER_PASS (10,000) host_refusal calls (kinds x live hosts; one kind at
--   least). 1,000 runs of 1,000 different kinds on 300 hosts are explained 33 kinds a pass, instead of
--   one pass of 300,000 refusals that outlives the statement_timeout, is rolled back, and so never ends.
--   A pass that reaches the end of the queue makes the next one start from the beginning.
-- * plpgsql, to keep that place; the work is still one statement.
-- Since 033 its kinds hold host_labels too (host_refusal reads them).
-- Since 042 a round over the waiting runs is not started from the same wait_mark twice before its
-- explained_until (the head of 042 says what the mark holds).
CREATE FUNCTION unitvisor.explain_waiting(min_wait interval, max_runs integer DEFAULT 1000)
RETURNS integer LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    refusals_per_pass constant integer := 10000;
    after_at timestamptz;
    after_job bigint;
    max_kinds integer;
    candidates integer;
    cut boolean;
    last_at timestamptz;
    last_job bigint;
    written integer;
    mark text;
BEGIN
    SELECT u.explained_at, u.explained_job INTO after_at, after_job FROM unitvisor.fleet_upkeep u;
    IF after_at IS NULL THEN
        -- A pass over the waiting runs would start: not when its last one started from the same mark.
        mark := unitvisor.wait_mark() || '/' || explain_waiting.min_wait;  -- a daemon's own min_wait: its own round
        IF (SELECT u.explained_mark = mark AND now() < u.explained_until FROM unitvisor.fleet_upkeep u) THEN
            RETURN 0;
        END IF;
        UPDATE unitvisor.fleet_upkeep u SET explained_mark = mark,
            explained_until = least(now() + 15 * explain_waiting.min_wait, unitvisor.next_due(explain_waiting.min_wait));
    END IF;
    SELECT greatest(1, refusals_per_pass / greatest(count(*), 1))::integer INTO max_kinds
    FROM unitvisor.hosts h WHERE unitvisor.host_is_live(h);
    WITH candidate AS MATERIALIZED (
        SELECT j.id AS job_id, j.scheduled_at, r AS run,
               jsonb_build_array(r.argv[1], r.run_user, r.environment, r.memory_max, r.host_pin, r.host_labels) AS kind,
               row_number() OVER (ORDER BY j.scheduled_at, j.id) AS pos
        FROM unitvisor.spawn_jobs j JOIN unitvisor.runs r ON r.id = j.run_id
        WHERE j.state = 'available' AND j.scheduled_at <= now() - explain_waiting.min_wait AND r.state = 'queued'
          AND (after_at IS NULL OR (j.scheduled_at, j.id) > (after_at, after_job))
        ORDER BY j.scheduled_at, j.id LIMIT explain_waiting.max_runs
    ),
    -- Where the first kind past max_kinds first appears: the pass stops just before it.
    cutoff AS (
        SELECT f.first FROM (SELECT min(c.pos) AS first FROM candidate c GROUP BY c.kind) f
        ORDER BY f.first OFFSET max_kinds LIMIT 1
    ),
    due AS MATERIALIZED (
        SELECT c.* FROM candidate c WHERE c.pos < coalesce((SELECT cutoff.first FROM cutoff), c.pos + 1)
    ),
    kinds AS MATERIALIZED (
        SELECT k.kind, unitvisor.fleet_refusal(k.run) AS refused
        FROM (SELECT DISTINCT ON (d.kind) d.kind, d.run FROM due d ORDER BY d.kind) k
    ),
    waiting AS MATERIALIZED (
        SELECT (d.run).id AS id, nullif(concat_ws('; ', 'waits for ' || unitvisor.key_blocker_text(d.run),
                                                  unitvisor.limit_text(d.run), k.refused), '') AS reason
        FROM due d JOIN kinds k ON k.kind = d.kind
    ),
    -- A reason that appears or changes; ON CONFLICT sees a concurrent pass's committed row, so two
    -- passes at once write one event.
    changed AS (
        INSERT INTO unitvisor.run_waits AS x (run_id, reason)
        SELECT w.id, w.reason FROM waiting w WHERE w.reason IS NOT NULL
        ON CONFLICT (run_id) DO UPDATE SET reason = excluded.reason WHERE x.reason IS DISTINCT FROM excluded.reason
        RETURNING x.run_id AS id, x.reason
    ),
    cleared AS (
        DELETE FROM unitvisor.run_waits x USING waiting w WHERE x.run_id = w.id AND w.reason IS NULL
        RETURNING 1
    ),
    events AS (
        INSERT INTO unitvisor.run_events (run_id, state, reason)
        SELECT c.id, 'queued', 'waiting: ' || c.reason FROM changed c
        RETURNING 1
    ),
    last AS (
        SELECT d.scheduled_at, d.job_id FROM due d ORDER BY d.pos DESC LIMIT 1
    )
    SELECT (SELECT count(*) FROM events)::integer, (SELECT count(*) FROM candidate)::integer,
           EXISTS (SELECT 1 FROM cutoff), (SELECT last.scheduled_at FROM last), (SELECT last.job_id FROM last)
    INTO written, candidates, cut, last_at, last_job;
    -- A pass that was neither cut nor full reached the end: the next one starts from the beginning.
    IF NOT cut AND candidates < explain_waiting.max_runs THEN
        last_at := NULL;
        last_job := NULL;
    END IF;
    UPDATE unitvisor.fleet_upkeep u SET explained_at = last_at, explained_job = last_job
    WHERE u.explained_at IS DISTINCT FROM last_at OR u.explained_job IS DISTINCT FROM last_job;
    RETURN written;
END $$;

-- == functions: claiming, starting and settling attempts (the host's API) ===========================

-- claim_jobs' memo of one answer per kind of run: `memo` with `kind` set to `answer`, unless it holds
-- 64 kinds already (the claim then asks again for further kinds: a bound on its memory, not on its
-- answers).
CREATE FUNCTION unitvisor.claim_memo(memo jsonb, kind text, answer boolean) RETURNS jsonb
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE WHEN (SELECT count(*) FROM jsonb_object_keys(memo)) >= 64 THEN memo
                ELSE memo || jsonb_build_object(kind, answer) END
$$;

-- The fleet's claims that walk the queue at once, at most `unitvisor.claim_slots` of them (046; 4 when
-- unset or not a whole number; 0 or less: no bound). A burst wakes every host, and hundreds of claims
-- walking the same head of the queue at once cost the server more for each run they take than a few one
-- after the other: on a throwaway PostgreSQL 15 with 2 cores (bench.claim_slots), 10,000 runs claimed by
-- 300 hosts at once took 5.3 ms of server CPU a run and 30 s, by 16 hosts 0.96 ms and 5.5 s, and by 300
-- hosts with 4 slots 1.34 ms and 8.5 s. A slot is a transaction-level advisory lock, released when the
-- claim's transaction ends: a free one is taken at once (tried from a random one on, so that claims spread
-- over them); when none is free the claim waits in one's queue, which costs no CPU. A claim that has waited
-- the session's lock_timeout walks without a slot rather than fail: the bound is for the server's sake, and
-- a claim that never comes would cost the run more than a claim in excess. The operator sets it for a
-- database: ALTER DATABASE ... SET unitvisor.claim_slots = 8 (docs/fleet.md, "The ceiling of one
-- PostgreSQL").
-- Since 050 the wait is up to 10 s, not the session's lock_timeout (5 s), and ends 5 s before the claim
-- statement's statement_timeout would: in a burst most claims waited the 5 s out and then walked all at
-- once, which the slots are there to prevent, and a claim must not fail for want of a slot.
CREATE FUNCTION unitvisor.take_claim_slot() RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp SET lock_timeout = '10s' AS $$
DECLARE
    setting text := current_setting('unitvisor.claim_slots', true);
    slots integer := CASE WHEN setting ~ '^\s*-?[0-9]{1,9}\s*$' THEN setting::integer ELSE 4 END;
    first integer;
    -- 050: at most the SET clause's lock_timeout (10 s), and never so long that the claim's statement_timeout
    -- would end it: 5 s of it are left for the walk.
    statement_ms double precision := extract(epoch FROM current_setting('statement_timeout')::interval) * 1000;
    wait_ms double precision := extract(epoch FROM current_setting('lock_timeout')::interval) * 1000;
BEGIN
    IF slots <= 0 THEN
        RETURN;
    END IF;
    first := floor(random() * slots)::integer;
    FOR i IN 0 .. slots - 1 LOOP
        IF pg_try_advisory_xact_lock(hashtextextended('unitvisor-claim-slot:' || (first + i) % slots, 0)) THEN
            RETURN;
        END IF;
    END LOOP;
    IF statement_ms > 0 THEN
        wait_ms := least(wait_ms, statement_ms - 5000
                                  - extract(epoch FROM clock_timestamp() - statement_timestamp()) * 1000);
    END IF;
    IF wait_ms < 1 THEN
        RETURN;  -- no time left to wait: walk without one
    END IF;
    -- Local to this call: the SET clause restores the session's lock_timeout for the walk.
    PERFORM set_config('lock_timeout', ceil(wait_ms)::bigint || 'ms', true);
    BEGIN
        PERFORM pg_advisory_xact_lock(hashtextextended('unitvisor-claim-slot:' || first, 0));
    EXCEPTION WHEN lock_not_available THEN
        NULL;  -- waited its time: walk without one
    END;
END $$;

-- claim_jobs as in 013, with two changes:
-- * its query passes over the jobs of a key but the one key_head_jobs names (the key's head, when it may
--   start) on the job's row: 013 joined each to its run and asked concurrency_blocker, for every one, on
--   every claim. The check stays on the head (and again under the key's lock, as in 006).
-- * `busy` (the open attempts of the live hosts that can start units) is the sum of their counts in
--   host_open_attempts: one row per host, not one per open attempt of the fleet.
-- The rest is 013's, line for line, but the named limits (032): a run about to be claimed is passed
-- over when a limit it falls under is full (claim_limits, after the key's check), and the limit is
-- remembered as full for the rest of the claim. Since 033: host_labels in its kinds, a job passed over by
-- the host it avoids (avoid_host) while another live host accepts it, until avoid_failed_host_grace
-- after it is due, and the event saying why it took it anyway. Since 039: the job's lock before the key's
-- and the limits', and a job another claim holds or took passed over without counting as looked at.
-- Since 046: it takes one of the fleet's claim slots (take_claim_slot) when the host has a free run slot;
-- since 049, before the fence's lock on the host's row.
CREATE FUNCTION unitvisor.claim_jobs(
    host_id text, host_epoch bigint, batch integer, unit_format text,
    starve_after interval DEFAULT '5 minutes', spread_grace interval DEFAULT '1 second')
RETURNS TABLE (run_id uuid, attempt integer, unit_name text, claimed_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    me unitvisor.hosts;
    in_flight integer;
    memory_used bigint;
    free integer;
    capacity bigint;
    busy bigint;
    waiting bigint;
    share bigint;
    shared integer := 0;
    taken integer := 0;
    looked integer := 0;
    gone integer := 0;  -- 039: jobs another claim holds, or took since this walk began
    next_attempt integer;
    name text;
    enough bigint;
    refusals jsonb := '{}';
    accepted jsonb := '{}';
    contested boolean;
    heads bigint[];
    -- 032: the selectors of the named limits this claim found full (or being decided by another claim).
    saturated jsonb[] := '{}';
    full_limit text;
    -- (A bound cursor, planned for its first rows: sql/009_claim_cost.sql.) Still one walk of
    -- spawn_jobs_available_idx in claim order, as 013's: a job of a key that is not its key's head is
    -- passed over on the job's own row (its concurrency_key column), before the join to its run and
    -- without a concurrency_blocker. (A merge of two streams, keyless jobs and heads, was tried: the
    -- planner sorted the whole queue for it, every claim of a burst.)
    jobs CURSOR FOR
        SELECT j.id, j.run_id, j.scheduled_at, r.state AS run_state, r.memory_max, r.concurrency_key,
               -- The memos' key: every column host_refusal and also_accepted read, host_pin too (as
               -- explain_waiting's kind and run_kind). Both memos are read for pinned runs (the avoid path
               -- below; a pinned run's refusal here), and no other host accepts a run pinned to this one:
               -- without host_pin an unpinned run's answer would stand for a pinned one's of the same
               -- command, and the reverse (a pinned-to-me retry passed over for the grace with a false
               -- event, or an unpinned retry taken at once on its failed host).
               r.host_pin, jsonb_build_array(r.argv[1], r.run_user, r.environment, r.memory_max, r.host_pin,
                                             r.host_labels)::text AS kind,
               r AS run, j.avoid_host
        FROM unitvisor.spawn_jobs j JOIN unitvisor.runs r ON r.id = j.run_id
        WHERE j.state = 'available' AND j.scheduled_at <= now()
          AND (heads IS NULL OR j.concurrency_key IS NULL OR j.id = ANY (heads))
          AND (r.state <> 'queued' OR ((r.host_pin IS NULL OR r.host_pin = me.id)
                                       AND (r.concurrency_key IS NULL OR unitvisor.concurrency_blocker(r) IS NULL)
                                       AND (r.start_deadline IS NULL OR NOT unitvisor.is_overdue(r))))
        ORDER BY j.priority DESC, j.scheduled_at, j.id
        ;
BEGIN
    -- 049: the fleet's claim slot before the fence, whose share lock on this host's row is held to the end of
    -- the transaction: taken after it, a claim waiting for a slot held the row, and the host's heartbeat
    -- (an update of that row) waited behind its own claim, up to lock_timeout. A host whose run slots are
    -- all taken (host_open_attempts, one row) takes no claim slot, as before.
    IF (SELECT h.max_runs > coalesce((SELECT c.open FROM unitvisor.host_open_attempts c WHERE c.host_id = h.id), 0)
        FROM unitvisor.hosts h WHERE h.id = claim_jobs.host_id) THEN
        PERFORM unitvisor.take_claim_slot();
    END IF;
    PERFORM unitvisor.check_fence(claim_jobs.host_id, claim_jobs.host_epoch);
    SELECT * INTO me FROM unitvisor.hosts h WHERE h.id = claim_jobs.host_id;
    IF me.state <> 'active' OR NOT me.can_start OR NOT unitvisor.host_is_live(me) THEN
        RETURN;
    END IF;
    SELECT count(*), coalesce(sum(r.memory_max), 0) INTO in_flight, memory_used
    FROM unitvisor.attempts a JOIN unitvisor.runs r ON r.id = a.run_id
    WHERE a.host_id = claim_jobs.host_id AND a.outcome IS NULL;
    free := least(claim_jobs.batch, me.max_runs - in_flight);
    IF free <= 0 THEN
        RETURN;
    END IF;
    SELECT coalesce(sum(h.max_runs), 0) INTO capacity FROM unitvisor.hosts h
    WHERE unitvisor.host_is_live(h) AND h.can_start;
    IF capacity > me.max_runs THEN
        enough := least(capacity, ceil((free + in_flight)::numeric * capacity / me.max_runs)::bigint);
        -- busy and waiting in one statement, from one snapshot (009).
        SELECT (SELECT coalesce(sum(c.open), 0) FROM unitvisor.hosts h
                JOIN unitvisor.host_open_attempts c ON c.host_id = h.id
                WHERE unitvisor.host_is_live(h) AND h.can_start),
               (SELECT count(*) FROM (
                    SELECT 1 FROM unitvisor.spawn_jobs j JOIN unitvisor.runs r ON r.id = j.run_id
                    WHERE j.state = 'available' AND j.scheduled_at <= now() AND r.state = 'queued'
                      AND (r.host_pin IS NULL OR r.host_pin = me.id)
                      AND (r.start_deadline IS NULL OR r.start_deadline > now())
                    LIMIT greatest(enough, 0)) w)
        INTO busy, waiting;
        share := ceil((busy + waiting)::numeric * me.max_runs / capacity)::bigint - in_flight;
    ELSE
        share := free;  -- no other live host: nothing to share
    END IF;
    heads := unitvisor.key_head_jobs();
    FOR job IN jobs LOOP
        IF job.run_state = 'queued' THEN
            IF refusals ? job.kind THEN
                CONTINUE WHEN (refusals ->> job.kind)::boolean;
            ELSIF unitvisor.host_refusal(me, job.run) IS NOT NULL THEN
                refusals := unitvisor.claim_memo(refusals, job.kind, true);
                CONTINUE;
            ELSE
                refusals := unitvisor.claim_memo(refusals, job.kind, false);
            END IF;
            -- 033: the host its last attempt failed on passes it over while another live host would take
            -- it, for avoid_failed_host_grace after it is due (also_accepted, remembered per kind as below).
            IF job.avoid_host = me.id AND job.scheduled_at > now() - unitvisor.avoid_failed_host_grace() THEN
                IF NOT accepted ? job.kind THEN
                    accepted := unitvisor.claim_memo(accepted, job.kind, unitvisor.also_accepted(me, job.run));
                END IF;
                CONTINUE WHEN coalesce((accepted ->> job.kind)::boolean, unitvisor.also_accepted(me, job.run));
            END IF;
        END IF;
        -- A named limit found full by this claim (032): its runs are passed over without counting again.
        CONTINUE WHEN job.run_state = 'queued' AND (job.run).labels @> ANY (saturated);
        looked := looked + 1;
        IF job.run_state <> 'queued' THEN
            PERFORM 1 FROM unitvisor.spawn_jobs j WHERE j.id = job.id AND j.state = 'available'
                FOR UPDATE SKIP LOCKED;
            CONTINUE WHEN NOT FOUND;  -- another claim has it
            UPDATE unitvisor.spawn_jobs j SET state = 'discarded', claimed_by = claim_jobs.host_id,
                claimed_at = now(), error = 'run is already ' || job.run_state
            WHERE j.id = job.id;
            CONTINUE;
        END IF;
        EXIT WHEN taken >= free OR looked > 4 * claim_jobs.batch;
        IF share >= free OR job.host_pin IS NOT NULL THEN
            contested := false;
        ELSIF accepted ? job.kind THEN
            contested := (accepted ->> job.kind)::boolean;
        ELSE
            contested := unitvisor.also_accepted(me, job.run);
            accepted := unitvisor.claim_memo(accepted, job.kind, contested);
        END IF;
        IF contested AND shared >= share AND job.scheduled_at > now() - claim_jobs.spread_grace THEN
            CONTINUE;  -- another host's share, for now
        END IF;
        IF me.memory_budget IS NOT NULL AND memory_used + coalesce(job.memory_max, 0) > me.memory_budget THEN
            -- A starved run reserves the host only if it could start once memory is free: under a full
            -- named limit (max_live 0 used as a pause, say) it could not, and the host would run under
            -- capacity for as long as the limit stays full. So its limits are asked first (claim_limits:
            -- a limit it finds not full stays locked until this claim's transaction ends, which is now).
            IF job.scheduled_at < now() - claim_jobs.starve_after THEN
                full_limit := unitvisor.claim_limits(job.run);
                EXIT WHEN full_limit IS NULL;  -- it reserves the host
                saturated := saturated || (SELECT l.selector FROM unitvisor.limits l WHERE l.name = full_limit);
            END IF;
            CONTINUE;  -- backfill: a smaller run behind it may fit
        END IF;
        -- The job's own lock first (039), then the key's and the limits': a job that another claim holds,
        -- or took since this walk's snapshot, is passed over for one lookup, and is not one this claim
        -- looked at. A job locked here and then passed over (its key held or blocked, a limit full) stays
        -- locked until this claim ends, a moment in which no other claim could take it either but rarely:
        -- the key and the limits are the fleet's, not this host's.
        PERFORM 1 FROM unitvisor.spawn_jobs j WHERE j.id = job.id AND j.state = 'available' FOR UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            looked := looked - 1;
            gone := gone + 1;
            EXIT WHEN gone > 32 * claim_jobs.batch;
            CONTINUE;
        END IF;
        IF job.concurrency_key IS NOT NULL THEN
            -- The key's lock, then the decision again from a snapshot taken after it (006).
            CONTINUE WHEN NOT pg_try_advisory_xact_lock(hashtextextended('unitvisor-concurrency-key:' || job.concurrency_key, 0));
            CONTINUE WHEN (SELECT unitvisor.concurrency_blocker(r) FROM unitvisor.runs r WHERE r.id = job.run_id) IS NOT NULL;
        END IF;
        -- The named limits the run falls under (032), each under its lock (claim_limits).
        full_limit := unitvisor.claim_limits(job.run);
        IF full_limit IS NOT NULL THEN
            saturated := saturated || (SELECT l.selector FROM unitvisor.limits l WHERE l.name = full_limit);
            CONTINUE;
        END IF;
        UPDATE unitvisor.spawn_jobs j SET state = 'claimed', claimed_by = claim_jobs.host_id, claimed_at = now()
        WHERE j.id = job.id;
        SELECT coalesce(max(a.attempt), 0) + 1 INTO next_attempt FROM unitvisor.attempts a WHERE a.run_id = job.run_id;
        name := format(claim_jobs.unit_format, job.run_id, next_attempt);
        UPDATE unitvisor.runs r SET state = 'starting', updated_at = now() WHERE r.id = job.run_id;
        DELETE FROM unitvisor.run_waits w WHERE w.run_id = job.run_id;
        INSERT INTO unitvisor.run_events (run_id, attempt, host_id, state, reason)
        VALUES (job.run_id, next_attempt, claim_jobs.host_id, 'starting', 'claimed by host ' || claim_jobs.host_id
                || CASE WHEN job.avoid_host IS DISTINCT FROM claim_jobs.host_id THEN ''
                        WHEN job.scheduled_at > now() - unitvisor.avoid_failed_host_grace()
                        THEN ', where its last attempt failed: no other live host accepts it'
                        ELSE format(', where its last attempt failed: no other host took it within %s s of its retry',
                                    extract(epoch FROM unitvisor.avoid_failed_host_grace())::integer) END);
        INSERT INTO unitvisor.attempts AS a (run_id, attempt, host_id, unit_name)
        VALUES (job.run_id, next_attempt, claim_jobs.host_id, name)
        RETURNING a.run_id, a.attempt, a.unit_name, a.claimed_at
        INTO claim_jobs.run_id, claim_jobs.attempt, claim_jobs.unit_name, claim_jobs.claimed_at;
        RETURN NEXT;
        taken := taken + 1;
        shared := shared + contested::integer;
        memory_used := memory_used + coalesce(job.memory_max, 0);
    END LOOP;
END $$;

-- mark_started as in 004, a start read by the host (adoption: systemd's own start time) kept within its
-- claim and now (host_time_on_db_clock, without an offset: the call carries no clock).
CREATE FUNCTION unitvisor.mark_started(run_id uuid, attempt integer, host_id text, host_epoch bigint,
                                                  invocation_id text, started_at timestamptz, reason text)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM unitvisor.check_fence(mark_started.host_id, mark_started.host_epoch);
    WITH started AS (
        UPDATE unitvisor.attempts a
        SET started_at = coalesce(a.started_at, unitvisor.host_time_on_db_clock(
                mark_started.started_at, NULL, a.claimed_at, now()), now()),
            invocation_id = coalesce(a.invocation_id, mark_started.invocation_id)
        WHERE a.run_id = mark_started.run_id AND a.attempt = mark_started.attempt AND a.outcome IS NULL
          AND a.host_id = mark_started.host_id
        RETURNING a.run_id),
    moved AS (
        UPDATE unitvisor.runs r SET state = 'running', updated_at = now()
        WHERE r.id IN (SELECT s.run_id FROM started s) AND r.state = 'starting' RETURNING r.id)
    INSERT INTO unitvisor.run_events (run_id, attempt, host_id, state, reason)
    SELECT m.id, mark_started.attempt, mark_started.host_id, 'running', mark_started.reason FROM moved m;
END $$;

-- An event about an attempt that changes no state (a stop on its way), by the attempt's own host or
-- one taking over a dead host's. False: no such attempt of its own.
CREATE FUNCTION unitvisor.record_event(run_id uuid, attempt integer, host_id text, host_epoch bigint,
                                       state text, reason text) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM unitvisor.check_fence(record_event.host_id, record_event.host_epoch);
    INSERT INTO unitvisor.run_events (run_id, attempt, host_id, state, reason)
    SELECT a.run_id, a.attempt, record_event.host_id, record_event.state, record_event.reason
    FROM unitvisor.attempts a
    WHERE a.run_id = record_event.run_id AND a.attempt = record_event.attempt
      AND (a.host_id = record_event.host_id
           OR EXISTS (SELECT 1 FROM unitvisor.hosts h WHERE h.id = a.host_id AND h.state = 'dead'));
    RETURN FOUND;
END $$;

-- mark_warned: the host sent the run's warn_signal to the attempt's unit (schema 026). Once per attempt:
-- true the first time, false after (or for an attempt not open on this host), so that a daemon that
-- restarts does not warn twice. Its event says what was sent.
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

-- Failure rules (027): whether a run is tried again after an attempt that did not succeed, and why
-- not or why so. The one decision, for every writer of an outcome: record_outcome takes it whatever
-- the writer proposed (the daemon's next state is a proposal; a 0.8.0 daemon's knows none of these
-- rules, a peer settling a dead host's attempt knows nothing of the run's), and supervisor/outcomes.py
-- failure_verdict is its twin for the daemon's proposal and log (tests/integration/test_failure_rules.py
-- compares the two over every case). `lost` is the number of the run's attempts lost with their host,
-- this one included; `attempt` this attempt's number. In order, the first that applies:
--   1. a cancel was requested, or the outcome is no failure (success, cancelled, refused): no retry;
--   2. fail_on names the attempt's exit status (exit:N of an exit-code, signal:NAME of a signal or a
--      core-dump): no retry, whatever retry_on says;
--   3. retry_on (NULL: every failure kind) names neither the outcome nor that exit status: no retry;
--   4. a lost attempt that does not count (count_lost false): retried while the run has had fewer than
--      max_lost_attempts lost attempts, ended at that cap;
--   5. retried while the attempts that count (every one, less the lost ones that do not) are fewer
--      than max_attempts.
-- why is NULL where the run ends or goes on as it did before 027 (so events read as they did).
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

-- A host's pending freeze requests: its open attempts whose request it has not answered.
CREATE FUNCTION unitvisor.freeze_requests(host_id text, host_epoch bigint)
RETURNS TABLE (run_id uuid, attempt integer, unit_name text, wanted text, requested_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM unitvisor.check_fence(freeze_requests.host_id, freeze_requests.host_epoch);
    RETURN QUERY
    SELECT a.run_id, a.attempt, a.unit_name, a.freeze_wanted, a.freeze_requested_at FROM unitvisor.attempts a
    WHERE a.host_id = freeze_requests.host_id AND a.outcome IS NULL AND unitvisor.freeze_pending(a)
    ORDER BY a.freeze_requested_at;
END $$;

-- What the host did with the request of requested_at: the unit's freezer state after it, and why it
-- was refused (NULL: done). Fenced, on the host's own open attempt only. A newer request made meanwhile
-- stays pending (freeze_acted_on is this one's time). False: no such open attempt of this host.
CREATE FUNCTION unitvisor.record_freeze(host_id text, host_epoch bigint, run_id uuid, attempt integer,
                                        requested_at timestamptz, state text, refused text) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    done unitvisor.attempts;
BEGIN
    PERFORM unitvisor.check_fence(record_freeze.host_id, record_freeze.host_epoch);
    IF record_freeze.state IS NULL OR record_freeze.state NOT IN ('frozen', 'thawed') THEN
        RAISE EXCEPTION 'state: must be frozen or thawed, not %', coalesce(record_freeze.state, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    UPDATE unitvisor.attempts a SET freeze_state = record_freeze.state, freeze_refused = record_freeze.refused,
        freeze_acted_at = now(), freeze_acted_on = record_freeze.requested_at
    WHERE a.run_id = record_freeze.run_id AND a.attempt = record_freeze.attempt
      AND a.host_id = record_freeze.host_id AND a.outcome IS NULL
    RETURNING a.* INTO done;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    INSERT INTO unitvisor.run_events (run_id, attempt, host_id, state, reason)
    VALUES (done.run_id, done.attempt, done.host_id, 'running', unitvisor.freeze_text(done));
    RETURN true;
END $$;

-- record_outcome: one attempt's outcome, from the host that ran it (or took it over). Four forms,
-- one per daemon generation that calls it by position; the shorter ones, below, hand over to this
-- one, so that the outcome logic exists once.
--
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

-- The 17-argument form (0.6.x daemons): the same outcome, no tasks peak. Replaced in place, so that its
-- grants stay; the 16- and 12-argument forms reach it, and so this one body.
CREATE FUNCTION unitvisor.record_outcome(
    run_id uuid, attempt integer, host_id text, host_epoch bigint, outcome text, exit_status text,
    reason text, next_state text, retry_delay interval, invocation_id text, started_at timestamptz,
    ended_at timestamptz, cpu_usage_nsec bigint, memory_peak_bytes bigint, io_read_bytes bigint,
    io_write_bytes bigint, host_clock timestamptz) RETURNS boolean
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT unitvisor.record_outcome($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17,
                                    NULL::bigint)
$$;

-- The 16-argument form (0.4.0 to 0.5.x daemons): the same outcome, no clock reading. Replaced in place,
-- so that its grants stay; the 12-argument form (007) reaches it, and so this one body.
CREATE FUNCTION unitvisor.record_outcome(
    run_id uuid, attempt integer, host_id text, host_epoch bigint, outcome text, exit_status text,
    reason text, next_state text, retry_delay interval, invocation_id text, started_at timestamptz,
    ended_at timestamptz, cpu_usage_nsec bigint, memory_peak_bytes bigint, io_read_bytes bigint,
    io_write_bytes bigint) RETURNS boolean
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT unitvisor.record_outcome($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16,
                                    NULL::timestamptz)
$$;

-- The 12-argument form (0.3.0 daemons): the same outcome, nothing measured. Replaced
-- in place, so that its grants stay; its body is the one above, reached with NULLs.
CREATE FUNCTION unitvisor.record_outcome(
    run_id uuid, attempt integer, host_id text, host_epoch bigint, outcome text, exit_status text,
    reason text, next_state text, retry_delay interval, invocation_id text, started_at timestamptz,
    ended_at timestamptz) RETURNS boolean
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT unitvisor.record_outcome($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12,
                                    NULL::bigint, NULL::bigint, NULL::bigint, NULL::bigint)
$$;

-- The output tails of ended attempts of the calling host, in one statement: the daemon reads each
-- from its journal a moment after the outcome is recorded (journald takes in a run's last lines
-- asynchronously), off the loop that records outcomes, and writes those it has together. Only an
-- attempt of its own that has an outcome and no tail yet takes one: a tail is written once, never
-- replaced, so history stays append-only. Returns how many attempts took theirs.
CREATE FUNCTION unitvisor.record_output_tails(host_id text, host_epoch bigint, run_ids uuid[], attempts integer[],
                                              output_tails text[]) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    written integer;
BEGIN
    PERFORM unitvisor.check_fence(record_output_tails.host_id, record_output_tails.host_epoch);
    IF cardinality(record_output_tails.run_ids) IS DISTINCT FROM cardinality(record_output_tails.attempts)
            OR cardinality(record_output_tails.run_ids) IS DISTINCT FROM cardinality(record_output_tails.output_tails) THEN
        RAISE EXCEPTION 'run_ids, attempts and output_tails: must be arrays of the same length'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- Checked here so that the error says which bound, and never echoes a tail (output may hold secrets).
    IF EXISTS (SELECT 1 FROM unnest(record_output_tails.output_tails) AS t(tail) WHERE octet_length(t.tail) > 65536) THEN
        RAISE EXCEPTION 'output_tails: a tail is more than the 65536 bytes an attempt keeps'
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'attempts',
                  CONSTRAINT = 'attempts_output_tail_valid';
    END IF;
    UPDATE unitvisor.attempts a SET output_tail = t.tail
    FROM unnest(record_output_tails.run_ids, record_output_tails.attempts, record_output_tails.output_tails)
         AS t(run_id, attempt, tail)
    WHERE a.run_id = t.run_id AND a.attempt = t.attempt AND a.host_id = record_output_tails.host_id
      AND a.outcome IS NOT NULL AND a.output_tail IS NULL AND t.tail IS NOT NULL;
    GET DIAGNOSTICS written = ROW_COUNT;
    RETURN written;
END $$;

-- expire_overdue_runs as in 006, with the started-once test in the candidates' query, before the LIMIT.
CREATE FUNCTION unitvisor.expire_overdue_runs(max_runs integer DEFAULT 1000) RETURNS integer
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    candidate record;
    overdue unitvisor.runs;
    why text;
    expired integer := 0;
BEGIN
    FOR candidate IN
        SELECT r.id FROM unitvisor.runs r
        WHERE r.state = 'queued' AND r.start_deadline IS NOT NULL AND r.start_deadline <= now()
          AND NOT EXISTS (SELECT 1 FROM unitvisor.attempts a WHERE a.run_id = r.id AND a.started_at IS NOT NULL)
        ORDER BY r.start_deadline LIMIT expire_overdue_runs.max_runs
    LOOP
        PERFORM 1 FROM unitvisor.spawn_jobs j WHERE j.run_id = candidate.id AND j.state = 'available'
            FOR UPDATE SKIP LOCKED;
        CONTINUE WHEN NOT FOUND AND EXISTS (SELECT 1 FROM unitvisor.spawn_jobs j
                                            WHERE j.run_id = candidate.id AND j.state = 'available');
        SELECT * INTO overdue FROM unitvisor.runs r WHERE r.id = candidate.id FOR UPDATE SKIP LOCKED;
        CONTINUE WHEN NOT FOUND OR NOT unitvisor.is_overdue(overdue);  -- locked, started, or moved on
        why := format('not started by its start deadline %s; it was waiting for %s',
                      to_char(overdue.start_deadline AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS "UTC"'),
                      unitvisor.waited_for(overdue));
        DELETE FROM unitvisor.spawn_jobs j WHERE j.run_id = candidate.id AND j.state = 'available';
        DELETE FROM unitvisor.run_waits w WHERE w.run_id = candidate.id;
        UPDATE unitvisor.runs r SET state = 'expired', finished_at = now(), updated_at = now()
        WHERE r.id = candidate.id;
        INSERT INTO unitvisor.run_events (run_id, state, reason) VALUES (candidate.id, 'expired', why);
        expired := expired + 1;
    END LOOP;
    RETURN expired;
END $$;

-- The daemons' call, in their fleet upkeep: any live host may expire any run, as any may explain why
-- one waits, so that a run no host could ever claim still expires.
CREATE FUNCTION unitvisor.expire_runs(host_id text, host_epoch bigint) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM unitvisor.check_fence(expire_runs.host_id, expire_runs.host_epoch);
    RETURN unitvisor.expire_overdue_runs();
END $$;

-- == functions: what a host may read ================================================================

-- The rule. `me` is the session's host id (unitvisor.my_host_id()), passed in so that a policy computes
-- it once per statement (a sub-select there), not once per row; it decides only the pin comparison, so a
-- caller passing another id learns nothing it could not read anyway. Inlined (see above): no sub-select,
-- no SET, qualified operators.
CREATE FUNCTION unitvisor.host_may_see(host_pin text, run_id uuid, me text) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT host_pin IS NULL OR host_pin OPERATOR(pg_catalog.=) me OR unitvisor.host_holds_run(run_id)
$$;

-- Whether the session's host has an attempt of this run, or a host declared dead left one of its
-- attempts open (the live hosts settle it as lost, so they must read it). As the owner: past the policy
-- on attempts, which itself asks runs.
CREATE FUNCTION unitvisor.host_holds_run(run_id uuid) RETURNS boolean
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT EXISTS (SELECT 1 FROM unitvisor.attempts a
                   WHERE a.run_id = host_holds_run.run_id
                     AND (a.host_id = unitvisor.my_host_id()
                          OR (a.outcome IS NULL
                              AND EXISTS (SELECT 1 FROM unitvisor.hosts h
                                          WHERE h.id = a.host_id AND h.state = 'dead'))))
$$;

-- How many attempts a host has open, whichever runs they are of: `unitvisor hosts` with a host's DSN
-- would otherwise count only those of runs it may see.
CREATE FUNCTION unitvisor.host_in_flight(host_id text) RETURNS bigint
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT count(*) FROM unitvisor.attempts a WHERE a.host_id = host_in_flight.host_id AND a.outcome IS NULL
$$;

-- The attempt behind each of these unit names (names without one are absent), as store.unit_owners read
-- it from attempts until now; for a run the caller may not see, only "open on another host" (host_id
-- NULL, outcome NULL) or "ended" (host_id NULL, outcome 'ended').
CREATE FUNCTION unitvisor.unit_owners(unit_names text[])
RETURNS TABLE (unit_name text, host_id text, outcome text)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT a.unit_name,
           CASE WHEN v.visible THEN a.host_id END,
           CASE WHEN v.visible THEN a.outcome WHEN a.outcome IS NOT NULL THEN 'ended' END
    FROM unitvisor.attempts a
    JOIN unitvisor.runs r ON r.id = a.run_id
    CROSS JOIN LATERAL (SELECT pg_has_role(session_user, 'unitvisor_admin', 'MEMBER')
                               OR unitvisor.host_may_see(r.host_pin, r.id, unitvisor.my_host_id()) AS visible) v
    WHERE a.unit_name = ANY(unit_owners.unit_names)
$$;

-- == functions: retention ===========================================================================

-- The states a run ends in, as retention sees them (006 added `expired`): the one list to extend when a
-- terminal state is added, in that state's migration: CREATE OR REPLACE this function with one more
-- element, and nothing else here changes. The index below does not name the states (finished_at is set
-- exactly when a run reaches a terminal state: 004's record_outcome and cancel_run, and 0.1.0's paths
-- before them), so a new state needs no new index, as long as it sets finished_at too.
CREATE FUNCTION unitvisor.retention_states() RETURNS text[]
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT ARRAY['succeeded', 'failed', 'cancelled', 'expired', 'skipped']::text[]
$$;

-- prune: delete one batch of history older than older_than, as the admin (`unitvisor prune`), or
-- count all of it (dry_run; batch_size is then ignored). Returns what it deleted (would delete), and
-- busy = true, deleting nothing, while another session's prune holds the lock: one pruner of the fleet
-- at a time (a transaction-level advisory lock, as declare_dead_hosts' upkeep; the others skip, and
-- the lock goes with the batch's commit, so a pruner that dies holds nothing). A caller loops while
-- runs or jobs come back equal to batch_size (more may be left), committing between calls.
--
-- What is never deleted: a run that is not in a terminal state, or whose finished_at is younger than
-- older_than, or that has an attempt without an outcome (whatever its state says: an admin's UPDATE,
-- a late outcome), or that another session holds locked right now (a resume, an outcome: SKIP LOCKED,
-- it is met again by the next batch); an available spawn job of a run that is kept; a run that a run
-- not yet ended names (035: needed_by_live_run), until that run has ended.
--
-- Invoker's rights, granted to nobody: the admin (the owner) runs it. Hosts prune through
-- prune_history below.
CREATE FUNCTION unitvisor.prune(older_than interval, batch_size integer DEFAULT 1000, dry_run boolean DEFAULT false)
RETURNS TABLE (runs bigint, attempts bigint, events bigint, jobs bigint, busy boolean)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    cutoff timestamptz;
    ids uuid[];
BEGIN
    IF prune.older_than IS NULL OR prune.older_than <= interval '0' THEN
        RAISE EXCEPTION 'older_than: must be more than zero (how old a finished run must be to go)'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF prune.batch_size IS NULL OR prune.batch_size NOT BETWEEN 1 AND 100000 THEN
        RAISE EXCEPTION 'batch_size: % is out of range (1 to 100000)', prune.batch_size
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    cutoff := now() - prune.older_than;
    IF coalesce(prune.dry_run, false) THEN
        RETURN QUERY
        WITH doomed AS (
            SELECT r.id FROM unitvisor.runs r
            WHERE r.finished_at < cutoff AND r.state = ANY (unitvisor.retention_states())
              AND NOT EXISTS (SELECT 1 FROM unitvisor.attempts a WHERE a.run_id = r.id AND a.outcome IS NULL)
              AND NOT unitvisor.needed_by_live_run(r.id))
        SELECT (SELECT count(*) FROM doomed),
               (SELECT count(*) FROM unitvisor.attempts a JOIN doomed d ON d.id = a.run_id),
               (SELECT count(*) FROM unitvisor.run_events e JOIN doomed d ON d.id = e.run_id),
               (SELECT count(*) FROM unitvisor.spawn_jobs j
                WHERE j.run_id IN (SELECT d.id FROM doomed d)
                   OR (j.state <> 'available' AND j.claimed_at < cutoff)),
               false;
        RETURN;
    END IF;
    IF NOT pg_try_advisory_xact_lock(hashtextextended('unitvisor-retention', 0)) THEN
        RETURN QUERY SELECT 0::bigint, 0::bigint, 0::bigint, 0::bigint, true;
        RETURN;
    END IF;
    -- The oldest first, on runs_finished_idx; locked, so that a resume or an outcome that comes now
    -- either waits for this batch (and then finds no run) or is skipped by it.
    SELECT array_agg(o.id) INTO ids FROM (
        SELECT r.id FROM unitvisor.runs r
        WHERE r.finished_at < cutoff AND r.finished_at IS NOT NULL AND r.state = ANY (unitvisor.retention_states())
          AND NOT EXISTS (SELECT 1 FROM unitvisor.attempts a WHERE a.run_id = r.id AND a.outcome IS NULL)
          AND NOT unitvisor.needed_by_live_run(r.id)
        ORDER BY r.finished_at
        LIMIT prune.batch_size
        FOR UPDATE OF r SKIP LOCKED) o;
    ids := coalesce(ids, '{}');
    -- Children first, each counted (ON DELETE CASCADE would delete them too, without a count).
    WITH gone AS (DELETE FROM unitvisor.run_events e WHERE e.run_id = ANY (ids) RETURNING 1)
    SELECT count(*) INTO events FROM gone;
    WITH gone AS (DELETE FROM unitvisor.attempts a WHERE a.run_id = ANY (ids) RETURNING 1)
    SELECT count(*) INTO attempts FROM gone;
    WITH gone AS (DELETE FROM unitvisor.spawn_jobs j WHERE j.run_id = ANY (ids) RETURNING 1)
    SELECT count(*) INTO jobs FROM gone;
    DELETE FROM unitvisor.run_waits w WHERE w.run_id = ANY (ids);
    WITH gone AS (DELETE FROM unitvisor.runs r WHERE r.id = ANY (ids) RETURNING 1)
    SELECT count(*) INTO runs FROM gone;
    -- Then the claimed and discarded jobs of runs that are kept, oldest first.
    WITH gone AS (
        DELETE FROM unitvisor.spawn_jobs j WHERE j.id IN (
            SELECT o.id FROM unitvisor.spawn_jobs o
            WHERE o.state <> 'available' AND o.claimed_at < cutoff
            ORDER BY o.claimed_at LIMIT prune.batch_size
            FOR UPDATE SKIP LOCKED)
        RETURNING 1)
    SELECT jobs + count(*) INTO jobs FROM gone;
    busy := false;
    RETURN NEXT;
END $$;

-- The least age a host may prune at: a control plane that reads a run's result after it finished
-- (run_status, on the unitvisor_run_finished NOTIFY or a poll) has at least this long to do it,
-- whatever a host's [retention] keep_finished says (a mistyped config, or a host role's DSN in the
-- wrong hands). The admin's `unitvisor prune` is not bound by it.
CREATE FUNCTION unitvisor.prune_history_min_age() RETURNS interval
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT interval '1 hour'
$$;

-- prune_history: prune's batch, as a host's daemon (its [retention] pass): fenced (a host declared
-- dead prunes nothing) and checked against the caller's identity as every host write, with older_than
-- at least prune_history_min_age() and batch_size at most 10000 (a batch is one transaction: it must
-- stay well under the session's statement_timeout). Deleting history is not a host's own business but
-- the fleet's: every host role may do it, because any one daemon of the fleet may be the one holding
-- the lock, but only for runs older than its argument and never younger than the floor above.
CREATE FUNCTION unitvisor.prune_history(host_id text, host_epoch bigint, older_than interval,
                                        batch_size integer DEFAULT 1000)
RETURNS TABLE (runs bigint, attempts bigint, events bigint, jobs bigint, busy boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM unitvisor.check_fence(prune_history.host_id, prune_history.host_epoch);
    IF prune_history.older_than IS NULL OR prune_history.older_than < unitvisor.prune_history_min_age() THEN
        RAISE EXCEPTION 'older_than: a host prunes only runs finished at least % ago (the admin''s unitvisor prune may go lower)',
            unitvisor.prune_history_min_age()
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF prune_history.batch_size IS NULL OR prune_history.batch_size NOT BETWEEN 1 AND 10000 THEN
        RAISE EXCEPTION 'batch_size: % is out of range (1 to 10000)', prune_history.batch_size
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN QUERY SELECT * FROM unitvisor.prune(prune_history.older_than, prune_history.batch_size, false);
END $$;

-- == notifications and triggers =====================================================================

-- NOTIFY is a wake-up hint only; daemons poll as well. One notification per statement, not per
-- row: a batch of 1000 submitted jobs wakes each daemon once.
-- No trigger calls it since 010 (spawn_jobs_notify calls notify_spawn_targets); left in place, as the
-- migrations only add, until a release drops what no supported daemon uses.
CREATE FUNCTION unitvisor.notify_spawn_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('unitvisor_spawn', '');
    RETURN NULL;
END $$;

-- What one inserting statement adds to its transaction's notes, of the jobs a host could claim now (038):
-- the number of unpinned runs (unitvisor.spawn_unpinned), the pins (unitvisor.spawn_pins, a JSON array), and the kinds of unpinned
-- run (unitvisor.spawn_kinds, a JSON array of what host_refusal reads, at most 33: more means "mixed").
CREATE FUNCTION unitvisor.note_spawn_jobs() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    unpinned bigint;
    pins jsonb;
    kinds jsonb;
    noted jsonb;
BEGIN
    -- The jobs a host could claim now (038): due, and without a concurrency key or among the first of their
    -- key's new runs, as many as the key has room for: its limit less its live runs and the queued runs
    -- ahead of them, which start first (concurrency_blocker). Each count stops at the limit: what a
    -- submit costs does not grow with a key's backlog.
    WITH fresh AS MATERIALIZED (
        SELECT r.id, r.host_pin, r.concurrency_key, r.seq, coalesce(r.concurrency_limit, 1) AS key_limit,
               r.argv[1] AS argv0, r.run_user,
               r.environment, r.memory_max, r.host_labels,
               row_number() OVER (PARTITION BY r.concurrency_key ORDER BY r.seq NULLS FIRST, r.created_at, r.id) AS place
        FROM new_jobs j JOIN unitvisor.runs r ON r.id = j.run_id
        WHERE j.state = 'available' AND j.scheduled_at <= now()),
    keys AS (
        SELECT k.concurrency_key,
               k.key_limit
               - (SELECT count(*) FROM (SELECT 1 FROM unitvisor.runs r
                                        WHERE r.concurrency_key = k.concurrency_key AND r.state IN ('starting', 'running')
                                        LIMIT k.key_limit) live)
               - (SELECT count(*) FROM (SELECT 1 FROM unitvisor.runs r
                                        WHERE r.concurrency_key = k.concurrency_key AND r.state = 'queued'
                                          AND (r.seq < k.first_seq OR r.seq IS NULL)
                                        LIMIT k.key_limit) ahead) AS room
        FROM (SELECT f.concurrency_key, min(f.seq) AS first_seq, min(f.key_limit) AS key_limit
              FROM fresh f WHERE f.concurrency_key IS NOT NULL GROUP BY f.concurrency_key) k),
    startable AS MATERIALIZED (
        SELECT f.* FROM fresh f LEFT JOIN keys k ON k.concurrency_key = f.concurrency_key
        WHERE f.concurrency_key IS NULL OR f.place <= k.room)
    SELECT (SELECT count(*) FROM startable s WHERE s.host_pin IS NULL),
           (SELECT coalesce(jsonb_agg(DISTINCT s.host_pin), '[]') FROM startable s WHERE s.host_pin IS NOT NULL),
           (SELECT coalesce(jsonb_agg(x.k), '[]') FROM (
                -- The environment's names only, each with an empty value: host_refusal reads the names,
                -- and the values (which may be secrets) must not go into the session's settings, where
                -- the submitter's current_setting, pg_settings and any error context would show them.
                SELECT DISTINCT jsonb_build_object('argv', ARRAY[s.argv0], 'run_user', s.run_user,
                                                   'environment', (SELECT coalesce(jsonb_object_agg(e.name, ''), '{}')
                                                                   FROM jsonb_object_keys(
                                                                       CASE WHEN jsonb_typeof(s.environment) = 'object'
                                                                            THEN s.environment ELSE '{}' END) AS e(name)),
                                                   'memory_max', s.memory_max,
                                                   -- 033: host_refusal reads them; fewer of them is accepted
                                                   -- by more hosts, as @> below assumes.
                                                   'host_labels', s.host_labels) AS k
                FROM startable s WHERE s.host_pin IS NULL
                LIMIT 33) x)
    INTO unpinned, pins, kinds;
    IF unpinned = 0 AND pins = '[]' THEN
        RETURN NULL;
    END IF;
    PERFORM set_config('unitvisor.spawn_unpinned',
        (unpinned + coalesce(nullif(current_setting('unitvisor.spawn_unpinned', true), '')::bigint, 0))::text, true);
    noted := coalesce(nullif(current_setting('unitvisor.spawn_pins', true), ''), '[]')::jsonb;
    IF NOT noted @> pins THEN  -- the common case, the same pins again, costs this test only
        SELECT jsonb_agg(DISTINCT p) INTO pins FROM (
            SELECT jsonb_array_elements(pins) AS p UNION SELECT jsonb_array_elements(noted)) x;
        PERFORM set_config('unitvisor.spawn_pins', pins::text, true);
    END IF;
    IF unpinned > 0 THEN
        noted := coalesce(nullif(current_setting('unitvisor.spawn_kinds', true), ''), '[]')::jsonb;
        -- A kind that one already noted contains (same argv[0], user and memory_max, environment names
        -- a superset) is accepted wherever that one is: host_refusal refuses on the names it finds.
        IF NOT noted @> kinds THEN
            SELECT jsonb_agg(k) INTO kinds FROM (
                SELECT k FROM (SELECT jsonb_array_elements(noted) AS k UNION SELECT jsonb_array_elements(kinds)) u
                LIMIT 33) x;
            PERFORM set_config('unitvisor.spawn_kinds', kinds::text, true);
        END IF;
    END IF;
    RETURN NULL;
END $$;

-- notify_spawn_targets as in 011, each live host's free slots from host_open_attempts (one row per host)
-- instead of a count of the fleet's open attempts grouped by host, in the submitter's COMMIT (020); since
-- 038, kinds of run that every live host with room refuses wake nobody; since 048, a host named among
-- at most 16 is told on its own channel when it listens there, and a notification naming nobody is
-- not sent.
CREATE FUNCTION unitvisor.notify_spawn_targets() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    wanted bigint := coalesce(nullif(current_setting('unitvisor.spawn_unpinned', true), '')::bigint, 0);
    pins text[] := ARRAY(SELECT jsonb_array_elements_text(
        coalesce(nullif(current_setting('unitvisor.spawn_pins', true), ''), '[]')::jsonb));
    kinds jsonb := coalesce(nullif(current_setting('unitvisor.spawn_kinds', true), ''), '[]')::jsonb;
    targets text[] := '{}';
    room text[];
    kind unitvisor.runs;
    widen boolean;
    nobody boolean;
    alone text;
    channel text;
    payload text;
BEGIN
    IF wanted = 0 AND cardinality(pins) = 0 THEN
        RETURN NULL;  -- done by an earlier event of this commit, or a statement that inserted no available job
    END IF;
    PERFORM set_config('unitvisor.spawn_unpinned', '', true), set_config('unitvisor.spawn_pins', '', true),
            set_config('unitvisor.spawn_kinds', '', true);
    IF wanted > 0 THEN
        WITH live AS (
            SELECT h.id, h.max_runs, h.max_runs - coalesce(c.open, 0) AS free
            FROM unitvisor.hosts h
            LEFT JOIN unitvisor.host_open_attempts c ON c.host_id = h.id
            WHERE unitvisor.host_is_live(h) AND h.can_start),
        fit AS (
            SELECT l.id, l.free,
                   least(l.free, ceil(wanted::numeric * l.max_runs / (SELECT sum(max_runs) FROM live))::bigint) AS takes
            FROM live l WHERE l.free > 0),
        ranked AS (
            SELECT f.id, sum(f.takes) OVER w - f.takes AS before, row_number() OVER w AS n
            FROM fit f WINDOW w AS (ORDER BY f.free DESC, f.id))
        SELECT coalesce(array_agg(id) FILTER (WHERE before < wanted OR n <= 2), '{}'), coalesce(array_agg(id), '{}')
        INTO targets, room FROM ranked;
        IF cardinality(targets) > 0 AND jsonb_array_length(kinds) > 32 THEN
            targets := room;  -- more kinds than noted (note_spawn_jobs keeps 33): every host with room, unasked
        ELSIF cardinality(targets) > 0 AND (cardinality(targets) < cardinality(room) OR cardinality(room) > 2) THEN
            -- Each kind: accepted by a host named, else by another host with room, else by none. One kind the
            -- named refuse and another accepts names every host with room (010); kinds that every host with
            -- room refuses name nobody (038). Not asked of one or two hosts with room, all named (011): waking
            -- them for nothing costs less than asking, on the latency of every submit.
            widen := false;
            nobody := jsonb_array_length(kinds) > 0;
            -- One row per kind, read once (in FROM: `(f()).*` in a select list calls f once a column):
            -- host_refusal is then asked with the same record per host.
            FOR kind IN SELECT r.* FROM jsonb_array_elements(kinds) AS e(k),
                                        jsonb_populate_record(NULL::unitvisor.runs, e.k) AS r LOOP
                IF EXISTS (SELECT 1 FROM unitvisor.hosts h
                           WHERE h.id = ANY (targets) AND unitvisor.host_refusal(h, kind) IS NULL) THEN
                    nobody := false;
                ELSIF EXISTS (SELECT 1 FROM unitvisor.hosts h
                              WHERE h.id = ANY (room) AND NOT h.id = ANY (targets)
                                AND unitvisor.host_refusal(h, kind) IS NULL) THEN
                    widen := true;
                    EXIT;
                END IF;
            END LOOP;
            IF widen THEN
                targets := room;
            ELSIF nobody THEN
                targets := '{}';
            END IF;
        END IF;
    END IF;
    targets := ARRAY(SELECT DISTINCT t FROM unnest(targets || pins) AS t ORDER BY t);
    IF cardinality(targets) <= 16 THEN
        -- Few named (a trickle of submits, a pin): each that listens on its own channel is told there, so
        -- that no other daemon wakes for it; the rest (daemons of 0.11.0) on unitvisor_spawn. More named
        -- (a burst names every host with room): one notification for all, as each one sent is an entry of
        -- the server's queue that every listening session of the database reads.
        FOR alone, channel IN SELECT h.id, unitvisor.own_channel(h) FROM unitvisor.hosts h
                              WHERE h.id = ANY (targets) LOOP
            CONTINUE WHEN channel IS NULL;
            PERFORM pg_notify(channel, '');
            targets := array_remove(targets, alone);
        END LOOP;
    END IF;
    IF cardinality(targets) = 0 THEN
        RETURN NULL;  -- every daemon would drop a notification that names nobody
    END IF;
    payload := json_build_object('hosts', targets)::text;
    PERFORM pg_notify('unitvisor_spawn', CASE WHEN octet_length(payload) > 7000 THEN '' ELSE payload END);
    RETURN NULL;
END $$;

-- Filled in from the run at every INSERT (since 033 with avoid_host, from the run's last attempt). SECURITY DEFINER: a submitter's session inserts through
-- submit_run (a definer already), but the trigger must read the run whoever inserts.
CREATE FUNCTION unitvisor.describe_spawn_job() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    run unitvisor.runs;
BEGIN
    SELECT * INTO run FROM unitvisor.runs r WHERE r.id = NEW.run_id;
    NEW.concurrency_key := run.concurrency_key;
    NEW.kind := unitvisor.run_kind(run);
    -- 033: the host the run's last attempt failed on, when its avoid_failed_host says to prefer another.
    -- Read here, once per job (one probe of the attempts' key), so that the claim reads it on the job's row.
    NEW.avoid_host := (SELECT CASE WHEN unitvisor.avoids_host(run.avoid_failed_host, a.outcome) THEN a.host_id END
                       FROM unitvisor.attempts a WHERE a.run_id = NEW.run_id ORDER BY a.attempt DESC LIMIT 1);
    RETURN NEW;
END $$;

-- Moves a host's count by `delta`. Row triggers with a WHEN clause: an update of an attempt that does not
-- open or settle it (mark_started, an output tail) costs no call.
CREATE FUNCTION unitvisor.count_open_attempt() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF TG_OP IN ('UPDATE', 'DELETE') AND OLD.outcome IS NULL THEN
        UPDATE unitvisor.host_open_attempts c SET open = c.open - 1 WHERE c.host_id = OLD.host_id;
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') AND NEW.outcome IS NULL THEN
        UPDATE unitvisor.host_open_attempts c SET open = c.open + 1 WHERE c.host_id = NEW.host_id;
        IF NOT FOUND THEN
            INSERT INTO unitvisor.host_open_attempts AS c (host_id, open) VALUES (NEW.host_id, 1)
            ON CONFLICT (host_id) DO UPDATE SET open = c.open + 1;
        END IF;
    END IF;
    RETURN NULL;
END $$;

-- Whenever a run reaches a state it ends in, succeeded, failed, cancelled, expired or skipped (by any
-- path: an outcome, a cancel of a queued run, an expiry, a skip, an admin's UPDATE), one notification on the documented channel unitvisor_run_finished
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

-- Every argument written to runs, checked as submit_run checks it (refuse_invalid_arguments says why a
-- trigger, not a CHECK).
CREATE TRIGGER runs_arguments_valid
    BEFORE INSERT OR UPDATE OF argv, environment, working_directory, run_user, memory_max, memory_high,
        cpu_quota_percent, tasks_max, io_weight, runtime_max_sec, max_attempts, retry_backoff_sec,
        retry_backoff_max_sec, retry_on, labels, idempotency_key, concurrency_key, not_before, start_deadline,
        stop_signal, stop_timeout, warn_before, warn_signal, fail_on, count_lost, max_lost_attempts,
        concurrency_limit
    ON unitvisor.runs
    FOR EACH ROW EXECUTE FUNCTION unitvisor.refuse_invalid_arguments();

-- A normalised argv[0] at submit time (refuse_unnormalised_argv0 says why a trigger, not a CHECK).
CREATE TRIGGER runs_argv0_normalised BEFORE INSERT OR UPDATE OF argv ON unitvisor.runs
    FOR EACH ROW EXECUTE FUNCTION unitvisor.refuse_unnormalised_argv0();

-- Placement's arguments (033), checked as submit_run checks them (refuse_invalid_placement).
CREATE TRIGGER runs_placement_valid BEFORE INSERT OR UPDATE OF host_labels ON unitvisor.runs
    FOR EACH ROW EXECUTE FUNCTION unitvisor.refuse_invalid_placement();

-- The completion signal on unitvisor_run_finished: one per run reaching a terminal state.
CREATE TRIGGER runs_notify_finished AFTER UPDATE OF state ON unitvisor.runs
    FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state
          AND NEW.state IN ('succeeded', 'failed', 'cancelled', 'expired', 'skipped'))
    EXECUTE FUNCTION unitvisor.notify_run_finished();

-- The settling of the runs that name a run, when it ends (settle_dependants).
CREATE TRIGGER runs_settle_dependants AFTER UPDATE OF state ON unitvisor.runs
    FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state
          AND NEW.state IN ('succeeded', 'failed', 'cancelled', 'expired', 'skipped'))
    EXECUTE FUNCTION unitvisor.settle_dependants();

-- The wake-up of the hosts that could claim a new spawn job: noted per statement, sent once per
-- transaction at commit (note_spawn_jobs and notify_spawn_targets say how).
CREATE TRIGGER spawn_jobs_note AFTER INSERT ON unitvisor.spawn_jobs
    REFERENCING NEW TABLE AS new_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION unitvisor.note_spawn_jobs();
CREATE CONSTRAINT TRIGGER spawn_jobs_notify AFTER INSERT ON unitvisor.spawn_jobs
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION unitvisor.notify_spawn_targets();

-- Every spawn job's concurrency key and kind, from its run, whoever inserts it.
CREATE TRIGGER spawn_jobs_describe BEFORE INSERT ON unitvisor.spawn_jobs
    FOR EACH ROW EXECUTE FUNCTION unitvisor.describe_spawn_job();

-- The open attempts per host (host_open_attempts): only an insert, settlement, move or delete of an open
-- attempt calls it.
CREATE TRIGGER attempts_count_insert AFTER INSERT ON unitvisor.attempts
    FOR EACH ROW WHEN (NEW.outcome IS NULL) EXECUTE FUNCTION unitvisor.count_open_attempt();
CREATE TRIGGER attempts_count_update AFTER UPDATE ON unitvisor.attempts
    FOR EACH ROW WHEN ((OLD.outcome IS NULL) <> (NEW.outcome IS NULL)
                       OR (OLD.outcome IS NULL AND OLD.host_id IS DISTINCT FROM NEW.host_id))
    EXECUTE FUNCTION unitvisor.count_open_attempt();
CREATE TRIGGER attempts_count_delete AFTER DELETE ON unitvisor.attempts
    FOR EACH ROW WHEN (OLD.outcome IS NULL) EXECUTE FUNCTION unitvisor.count_open_attempt();

-- == functions: schedules (028: docs/sql-api.md, Schedules) ====================================

-- One field of a cron expression as the sorted set of values it names; raises 22023 with a message
-- that starts with `cron:` and names the field. An item is `*`, a value, or a range `a-b`, each
-- optionally with a step `/n` (`a/n` is `a-<max>/n`); items are separated by commas; values are numbers
-- or, where `names` is given, names (the first three letters, any case: JAN, mon).
CREATE FUNCTION unitvisor.cron_field(field text, what text, lo integer, hi integer, names text[] DEFAULT NULL,
                                     names_from integer DEFAULT 0)
RETURNS integer[] LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    item text;
    parts text[];
    bounds text[];
    first_value integer;
    last_value integer;
    step integer;
    found integer[] := '{}';
    allowed text := format('%s to %s', lo, hi) || CASE WHEN names IS NOT NULL
        THEN format(' or %s to %s', upper(names[1]), upper(names[array_length(names, 1)])) ELSE '' END;
BEGIN
    FOREACH item IN ARRAY string_to_array(lower(field), ',') LOOP
        parts := regexp_match(item, '^(\*|[a-z0-9]+(?:-[a-z0-9]+)?)(?:/([0-9]{1,4}))?$');
        IF parts IS NULL THEN
            RAISE EXCEPTION 'cron: the % field has "%", which is not *, a value or a range a-b, with an optional /step',
                what, left(item, 40) USING ERRCODE = 'invalid_parameter_value';
        END IF;
        step := coalesce(parts[2]::integer, 1);
        IF step < 1 OR step > hi - lo + 1 THEN
            RAISE EXCEPTION 'cron: the % field has the step /%, out of range (1 to %)', what, step, hi - lo + 1
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF parts[1] = '*' THEN
            first_value := lo;
            last_value := hi;
        ELSE
            bounds := string_to_array(parts[1], '-');
            FOR i IN 1 .. array_length(bounds, 1) LOOP
                IF bounds[i] ~ '^[0-9]{1,4}$' THEN
                    last_value := bounds[i]::integer;
                ELSE
                    last_value := array_position(names, bounds[i]) - 1 + names_from;
                    IF last_value IS NULL THEN
                        RAISE EXCEPTION 'cron: the % field has "%", which is neither a number nor a name (%)',
                            what, bounds[i], allowed USING ERRCODE = 'invalid_parameter_value';
                    END IF;
                END IF;
                IF last_value < lo OR last_value > hi THEN
                    RAISE EXCEPTION 'cron: the % field has %, out of range (%)', what, last_value, allowed
                        USING ERRCODE = 'invalid_parameter_value';
                END IF;
                IF i = 1 THEN
                    first_value := last_value;
                END IF;
            END LOOP;
            IF array_length(bounds, 1) = 1 THEN
                last_value := CASE WHEN parts[2] IS NULL THEN first_value ELSE hi END;
            ELSIF first_value > last_value THEN
                RAISE EXCEPTION 'cron: the % field has the range %-%, which goes backwards (a range does not wrap)',
                    what, first_value, last_value USING ERRCODE = 'invalid_parameter_value';
            END IF;
        END IF;
        found := found || ARRAY(SELECT generate_series(first_value, last_value, step));
    END LOOP;
    RETURN ARRAY(SELECT DISTINCT v FROM unnest(found) v ORDER BY v);
END $$;

-- A cron expression: five fields separated by blanks (minute 0-59, hour 0-23, day of month 1-31, month
-- 1-12 or JAN-DEC, day of week 0-7 or SUN-SAT, 0 and 7 both Sunday), or one of @yearly (@annually),
-- @monthly, @weekly, @daily (@midnight), @hourly. No seconds field, no L, W, # or ?. As in Vixie cron and
-- cronie, when both day fields are restricted (neither starts with '*') a day matches either of them;
-- otherwise it must match both. Raises 22023 with a message that starts with `cron:`.
CREATE FUNCTION unitvisor.cron_parse(cron text) RETURNS unitvisor.cron_fields
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    expanded text;
    f text[];
    parsed unitvisor.cron_fields;
BEGIN
    IF cron IS NULL THEN
        RAISE EXCEPTION 'cron: must not be NULL' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    expanded := CASE lower(btrim(cron))
        WHEN '@yearly' THEN '0 0 1 1 *' WHEN '@annually' THEN '0 0 1 1 *' WHEN '@monthly' THEN '0 0 1 * *'
        WHEN '@weekly' THEN '0 0 * * 0' WHEN '@daily' THEN '0 0 * * *' WHEN '@midnight' THEN '0 0 * * *'
        WHEN '@hourly' THEN '0 * * * *' ELSE btrim(cron) END;
    f := regexp_split_to_array(expanded, '[ \t]+');
    IF length(cron) > 200 OR expanded = '' OR array_length(f, 1) <> 5 THEN
        RAISE EXCEPTION 'cron: must have 5 fields (minute hour day-of-month month day-of-week), or be @hourly, '
                        '@daily, @weekly, @monthly or @yearly; it has %', CASE WHEN length(cron) > 200
            THEN 'over 200 characters' ELSE format('%s field(s)', coalesce(array_length(f, 1), 0) * (expanded <> '')::integer) END
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    parsed.minutes := unitvisor.cron_field(f[1], 'minute', 0, 59);
    parsed.hours := unitvisor.cron_field(f[2], 'hour', 0, 23);
    parsed.days := unitvisor.cron_field(f[3], 'day-of-month', 1, 31);
    parsed.months := unitvisor.cron_field(f[4], 'month', 1, 12,
        ARRAY['jan', 'feb', 'mar', 'apr', 'may', 'jun', 'jul', 'aug', 'sep', 'oct', 'nov', 'dec'], 1);
    parsed.weekdays := ARRAY(SELECT DISTINCT d % 7 FROM unnest(unitvisor.cron_field(f[5], 'day-of-week', 0, 7,
        ARRAY['sun', 'mon', 'tue', 'wed', 'thu', 'fri', 'sat'], 0)) d ORDER BY 1);
    parsed.any_day := f[3] LIKE '*%';
    parsed.any_weekday := f[5] LIKE '*%';
    RETURN parsed;
END $$;

-- The instant a schedule's local (wall-clock) time stands for, in `timezone`: the rule for the days
-- clocks change, written once.
-- * A local time that occurs twice (clocks go back: 02:30 on the last Sunday of October in Europe/Berlin)
--   is due once, at its first occurrence (the summer-time one). cronie and Vixie cron do the same for a
--   job at a fixed time ("jobs that fall into the repeated time will not be re-run"); unlike them, a
--   job of every N minutes is not run again through the repeated hour either.
-- * A local time that does not exist that day (clocks go forward: 02:30 on the last Sunday of March in
--   Europe/Berlin) is due at the end of the gap, the first instant after it (03:00 summer time), so that
--   a daily 02:30 job still runs that day, as cronie runs such jobs "soon after the change"; several
--   times in one gap make one instant, so one run (robfig/cron, which Kubernetes' CronJob uses, skips
--   them instead).
-- PostgreSQL's own `AT TIME ZONE` is not that rule: it takes the second occurrence of a repeated time,
-- and moves a missing one forward by the gap's length (02:30 to 03:30).
CREATE FUNCTION unitvisor.cron_local_instant(local_time timestamp, timezone text) RETURNS timestamptz
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    guess timestamptz := local_time AT TIME ZONE timezone;
    earliest timestamptz;
    later timestamp := local_time;
BEGIN
    -- The offsets in force a day either side: a local time is one of these instants, if any.
    SELECT min(c.instant) INTO earliest FROM (
        SELECT (local_time - ((t AT TIME ZONE timezone) - (t AT TIME ZONE 'UTC'))) AT TIME ZONE 'UTC' AS instant
        FROM unnest(ARRAY[guess - interval '1 day', guess, guess + interval '1 day']) t
    ) c WHERE (c.instant AT TIME ZONE timezone) = local_time;
    IF earliest IS NOT NULL THEN
        RETURN earliest;
    END IF;
    -- In a gap: the first whole minute after it (gaps are whole minutes since 1970 everywhere).
    FOR i IN 1 .. 1440 LOOP
        later := later + interval '1 minute';
        IF ((later AT TIME ZONE timezone) AT TIME ZONE timezone) = later THEN
            RETURN later AT TIME ZONE timezone;
        END IF;
    END LOOP;
    RETURN guess;
END $$;

-- The first due time of `fields` strictly after `after`, in `timezone` (cron_local_instant's rule on the
-- days clocks change); NULL when none comes within 10 years (`0 0 30 2 *`).
CREATE FUNCTION unitvisor.cron_next(fields unitvisor.cron_fields, timezone text, after timestamptz)
RETURNS timestamptz LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    l timestamp := date_trunc('minute', after AT TIME ZONE timezone) + interval '1 minute';
    give_up timestamp := l + interval '10 years';
    next_value integer;
    instant timestamptz;
BEGIN
    IF fields IS NULL OR after IS NULL OR timezone IS NULL THEN
        RETURN NULL;
    END IF;
    -- Each step moves l to the next local time that could match; bounded by give_up (at most 120
    -- months, 3,653 days, 24 hours a day and one minute step per matching hour).
    WHILE l < give_up LOOP
        IF NOT extract(month FROM l)::integer = ANY (fields.months) THEN
            l := date_trunc('month', l) + interval '1 month';
            CONTINUE;
        END IF;
        IF NOT (CASE WHEN fields.any_day OR fields.any_weekday
                     THEN extract(day FROM l)::integer = ANY (fields.days)
                          AND extract(dow FROM l)::integer = ANY (fields.weekdays)
                     ELSE extract(day FROM l)::integer = ANY (fields.days)
                          OR extract(dow FROM l)::integer = ANY (fields.weekdays) END) THEN
            l := date_trunc('day', l) + interval '1 day';
            CONTINUE;
        END IF;
        IF NOT extract(hour FROM l)::integer = ANY (fields.hours) THEN
            SELECT min(h) INTO next_value FROM unnest(fields.hours) h WHERE h > extract(hour FROM l);
            l := date_trunc('day', l) + CASE WHEN next_value IS NULL THEN interval '1 day'
                                             ELSE make_interval(hours => next_value) END;
            CONTINUE;
        END IF;
        SELECT min(m) INTO next_value FROM unnest(fields.minutes) m WHERE m >= extract(minute FROM l);
        IF next_value IS NULL THEN
            l := date_trunc('hour', l) + interval '1 hour';
            CONTINUE;
        END IF;
        l := date_trunc('hour', l) + make_interval(mins => next_value);
        instant := unitvisor.cron_local_instant(l, timezone);
        -- A repeated local time already passed at its first occurrence, or a gap's end already due.
        IF instant > after THEN
            RETURN instant;
        END IF;
        l := l + interval '1 minute';
    END LOOP;
    RETURN NULL;
END $$;

-- The same, from the expression's text: what a control plane or a person asks
-- (`SELECT unitvisor.cron_next('30 2 * * *', 'Europe/Berlin', now())`).
-- Its owner's rights: the helpers it calls are nobody's API.
CREATE FUNCTION unitvisor.cron_next(cron text, timezone text, after timestamptz) RETURNS timestamptz
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT unitvisor.cron_next(unitvisor.cron_parse(cron), timezone, after)
$$;

-- submit_run called with a jsonb's keys as its named arguments ('{"argv": ["/bin/true"], "max_attempts":
-- 3}'), returning the run's id. A key that is not one of submit_run's argument names is refused by name,
-- and so is a value that is not of its argument's type; submit_run then checks each argument as it does
-- any call's. The names and types are read from submit_run's signature in pg_proc, so an argument added
-- to submit_run (at the end, defaulted, as every one is) is accepted here with no change: a key left out
-- gets submit_run's default, a JSON null is SQL NULL, a JSON array is a SQL array, a JSON object is
-- passed as jsonb where the argument is jsonb, and any other value is its text cast to the argument's type.
-- Invoker's rights: the caller needs EXECUTE on submit_run (the submitter has it).
CREATE FUNCTION unitvisor.submit_run_spec(spec jsonb) RETURNS uuid
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    target record;
    key text;
    value jsonb;
    pos integer;
    arg_type oid;
    expr text;
    args text[] := '{}';
    new_id uuid;
BEGIN
    IF spec IS NULL OR jsonb_typeof(spec) <> 'object' THEN
        RAISE EXCEPTION 'spec: must be a JSON object of submit_run''s argument names' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- The one submit_run (each migration that changes it drops the one before).
    SELECT p.proargnames AS names, p.proargtypes::oid[] AS types, p.pronargs - p.pronargdefaults AS required
    INTO STRICT target FROM pg_proc p
    WHERE p.pronamespace = 'unitvisor'::regnamespace AND p.proname = 'submit_run';
    FOR i IN 1 .. target.required LOOP
        IF NOT spec ? target.names[i] THEN
            RAISE EXCEPTION '%: required (the spec has no key "%")', target.names[i], target.names[i]
                USING ERRCODE = 'not_null_violation';
        END IF;
    END LOOP;
    FOR key, value IN SELECT e.key, e.value FROM jsonb_each(spec) e ORDER BY e.key LOOP
        pos := array_position(target.names, key);
        IF pos IS NULL THEN
            RAISE EXCEPTION 'spec: unknown key %, not one of submit_run''s arguments (docs/sql-api.md)',
                quote_literal(left(key, 64)) USING ERRCODE = 'invalid_parameter_value';
        END IF;
        arg_type := (SELECT t FROM unnest(target.types) WITH ORDINALITY u(t, n) WHERE u.n = pos);
        IF jsonb_typeof(value) = 'null' THEN
            expr := 'NULL';
        ELSIF arg_type = 'jsonb'::regtype THEN
            expr := quote_literal(value::text);
        ELSIF (SELECT t.typcategory = 'A' FROM pg_type t WHERE t.oid = arg_type) THEN
            IF jsonb_typeof(value) <> 'array'
               OR EXISTS (SELECT 1 FROM jsonb_array_elements(value) x WHERE jsonb_typeof(x) IN ('array', 'object')) THEN
                RAISE EXCEPTION '%: must be a JSON array of strings or numbers', key USING ERRCODE = 'invalid_parameter_value';
            END IF;
            expr := quote_literal(ARRAY(SELECT jsonb_array_elements_text(value))::text);
        ELSIF jsonb_typeof(value) IN ('array', 'object') THEN
            RAISE EXCEPTION '%: must be a JSON string, number or boolean, not an %', key, jsonb_typeof(value)
                USING ERRCODE = 'invalid_parameter_value';
        ELSE
            expr := quote_literal(value #>> '{}');
        END IF;
        expr := format('%s::%s', expr, format_type(arg_type, NULL));
        -- The value's cast on its own, so that a refusal names the key (and never echoes the value).
        BEGIN
            EXECUTE 'SELECT ' || expr;
        EXCEPTION WHEN data_exception THEN
            RAISE EXCEPTION '%: not a valid % (as a JSON %)', key, format_type(arg_type, NULL), jsonb_typeof(value)
                USING ERRCODE = 'invalid_parameter_value';
        END;
        args := args || format('%I => %s', key, expr);
    END LOOP;
    EXECUTE format('SELECT unitvisor.submit_run(%s)', array_to_string(args, ', ')) INTO new_id;
    RETURN new_id;
END $$;

-- The labels and idempotency key a schedule's run is submitted with: the key is (schedule, due time), so
-- that a second submit for the same due time, by whatever path, returns the first's run.
CREATE FUNCTION unitvisor.schedule_run_spec(s unitvisor.schedules, due timestamptz) RETURNS jsonb
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT s.run
        || jsonb_build_object('labels', coalesce(s.run -> 'labels', '{}'::jsonb)
                                        || jsonb_build_object('unitvisor/schedule', s.name,
                                                              'unitvisor/due', to_char(due AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"')),
                              'idempotency_key', format('unitvisor/schedule/%s/%s', s.name,
                                                        to_char(due AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"')))
        -- queue: behind the schedule's previous run, through a concurrency key (the run's own, if it has one).
        || CASE WHEN s.overlap = 'queue' AND NOT s.run ? 'concurrency_key'
                THEN jsonb_build_object('concurrency_key', 'unitvisor/schedule/' || s.name) ELSE '{}'::jsonb END
$$;

-- Create a schedule; returns its first due time. Each argument is checked, in order, with an error
-- (SQLSTATE 22023, or submit_run's own for the run) whose message starts with the argument's name.
CREATE FUNCTION unitvisor.create_schedule(name text, cron text, timezone text, run jsonb,
                                          overlap text DEFAULT 'skip', catch_up text DEFAULT 'none')
RETURNS timestamptz
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    fields unitvisor.cron_fields;
    first_due timestamptz;
    trial unitvisor.schedules;
    refused_message text;
    refused_state text;
    refused_constraint text;
BEGIN
    IF create_schedule.name IS NULL OR create_schedule.name !~ '^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$' THEN
        RAISE EXCEPTION 'name: must be 1 to 63 of A-Z a-z 0-9 . _ -, starting and ending with a letter or digit'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    fields := unitvisor.cron_parse(create_schedule.cron);
    IF create_schedule.timezone IS NULL
       OR NOT EXISTS (SELECT 1 FROM pg_timezone_names z WHERE z.name = create_schedule.timezone) THEN
        RAISE EXCEPTION 'timezone: % is not a time zone name of pg_timezone_names (such as UTC or Europe/Berlin)',
            coalesce(quote_literal(left(create_schedule.timezone, 64)), 'NULL') USING ERRCODE = 'invalid_parameter_value';
    END IF;
    first_due := unitvisor.cron_next(fields, create_schedule.timezone, now());
    IF first_due IS NULL THEN
        RAISE EXCEPTION 'cron: matches no time in the next 10 years' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF create_schedule.run IS NULL OR jsonb_typeof(create_schedule.run) <> 'object' THEN
        RAISE EXCEPTION 'run: must be a JSON object of submit_run''s argument names' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- The schedule sets the key itself; an absolute time would be the same for every run; river_job_id
    -- (034) links one run to one River job, and is the River source's to set.
    IF create_schedule.run ?| ARRAY['idempotency_key', 'not_before', 'start_deadline', 'river_job_id'] THEN
        RAISE EXCEPTION 'run: may not have %: a schedule''s runs share every key of it (the schedule sets '
                        'idempotency_key itself, an absolute time would be the same for each run, and '
                        'river_job_id links one run to one River job)',
            (SELECT string_agg(k, ', ' ORDER BY k) FROM jsonb_object_keys(create_schedule.run) k
             WHERE k IN ('idempotency_key', 'not_before', 'start_deadline', 'river_job_id'))
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF create_schedule.overlap IS NULL OR create_schedule.overlap NOT IN ('skip', 'queue', 'allow') THEN
        RAISE EXCEPTION 'overlap: must be skip, queue or allow' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF create_schedule.catch_up IS NULL OR create_schedule.catch_up NOT IN ('none', 'one') THEN
        RAISE EXCEPTION 'catch_up: must be none or one' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- The run as its first due time would submit it, submitted and rolled back (a subtransaction): every
    -- check submit_run makes, the labels the schedule adds included, made now rather than at 3 a.m.
    trial := ROW(create_schedule.name, create_schedule.cron, create_schedule.timezone, create_schedule.run,
                 create_schedule.overlap, create_schedule.catch_up, false, first_due, NULL, NULL, NULL, NULL,
                 0, 0, 0, now(), session_user)::unitvisor.schedules;
    BEGIN
        PERFORM unitvisor.submit_run_spec(unitvisor.schedule_run_spec(trial, first_due) - 'idempotency_key');
        RAISE EXCEPTION USING ERRCODE = 'UV028';
    EXCEPTION
        WHEN SQLSTATE 'UV028' THEN
            NULL;
        WHEN OTHERS THEN
            GET STACKED DIAGNOSTICS refused_message = MESSAGE_TEXT, refused_state = RETURNED_SQLSTATE,
                                    refused_constraint = CONSTRAINT_NAME;
            RAISE EXCEPTION 'run: %', refused_message USING ERRCODE = refused_state, CONSTRAINT = refused_constraint;
    END;
    BEGIN
        INSERT INTO unitvisor.schedules (name, cron, timezone, run, overlap, catch_up, next_due)
        VALUES (create_schedule.name, create_schedule.cron, create_schedule.timezone, create_schedule.run,
                create_schedule.overlap, create_schedule.catch_up, first_due);
    EXCEPTION WHEN unique_violation THEN
        RAISE EXCEPTION 'name: a schedule named % exists (drop_schedule it first)', create_schedule.name
            USING ERRCODE = 'unique_violation';
    END;
    RETURN first_due;
END $$;

-- Drop a schedule: true when there was one. Its runs already submitted are left as they are.
CREATE FUNCTION unitvisor.drop_schedule(name text) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    DELETE FROM unitvisor.schedules s WHERE s.name = drop_schedule.name;
    RETURN FOUND;
END $$;

-- Pause (paused => true) or resume (false) a schedule; returns whether it was paused before (NULL: no
-- such schedule). A paused schedule submits nothing; resumed, its next due time is the first after now:
-- the times it was paused through are neither run nor counted as missed.
CREATE FUNCTION unitvisor.pause_schedule(name text, paused boolean DEFAULT true) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    before boolean;
BEGIN
    IF pause_schedule.paused IS NULL THEN
        RAISE EXCEPTION 'paused: must not be NULL' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT s.paused INTO before FROM unitvisor.schedules s WHERE s.name = pause_schedule.name FOR UPDATE;
    IF before IS DISTINCT FROM pause_schedule.paused AND before IS NOT NULL THEN
        UPDATE unitvisor.schedules s SET paused = pause_schedule.paused,
            next_due = CASE WHEN pause_schedule.paused THEN s.next_due
                            ELSE unitvisor.cron_next(s.cron, s.timezone, now()) END
        WHERE s.name = pause_schedule.name;
    END IF;
    RETURN before;
END $$;

-- The fleet upkeep's step (store.submit_due_schedules): each schedule due now, taken with its row locked
-- (SKIP LOCKED: a schedule another host is submitting right now is that host's), its run submitted and
-- its next due time moved past now in the same transaction. One statement, autocommit: a host that dies
-- in it submitted nothing and moved nothing, and the next host to ask does both. The idempotency key
-- (schedule_run_spec) makes even a second submit for one due time return the first's run.
--
-- At most max_schedules schedules a pass, and none begun after `budget` of it. The due times a pass
-- reaches: next_due and every later one up to now (at most 1,000 counted; past that, those of the last
-- minute). The latest is on time when it is at most a minute old (a fleet that is up reaches it within a
-- poll interval or two); every other is missed. An on-time due time is
-- submitted; missed ones are dropped (catch_up none), or make one run, for the latest of them, when
-- no due time is on time (catch_up one). overlap skip: nothing is submitted while the schedule's last
-- run is queued, starting or running (counted as skipped). A run submit_run refuses (a schedule made
-- before a check was added) is said in last_result, and the schedule moves on.
CREATE FUNCTION unitvisor.submit_due_schedules(host_id text, host_epoch bigint, max_schedules integer DEFAULT 100,
                                               budget interval DEFAULT '2 seconds')
RETURNS TABLE (schedule text, due timestamptz, run_id uuid, result text, missed integer)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    late_after constant interval := interval '1 minute';
    counted_max constant integer := 1000;
    -- A pass takes no further schedule once it has worked `budget` (2 seconds): the rest are still due,
    -- and the next pass (a poll interval later, by any host) takes them. So that a pass after a long
    -- outage, with many schedules each counting up to counted_max missed times (about 0.2 ms each),
    -- stays well inside the daemons' statement_timeout (15 s) instead of being cancelled, rolled back
    -- and started again for ever.
    started timestamptz := clock_timestamp();
    me unitvisor.hosts;
    s unitvisor.schedules;
    fields unitvisor.cron_fields;
    d timestamptz;
    latest timestamptz;
    reached integer;
    on_time boolean;
    new_run uuid;
    said text;
BEGIN
    PERFORM unitvisor.check_fence(submit_due_schedules.host_id, submit_due_schedules.host_epoch);
    SELECT * INTO me FROM unitvisor.hosts h WHERE h.id = submit_due_schedules.host_id;
    IF NOT unitvisor.host_acts_for_fleet(me) THEN
        RETURN;
    END IF;
    FOR s IN SELECT * FROM unitvisor.schedules x WHERE NOT x.paused AND x.next_due <= now()
             ORDER BY x.next_due, x.name LIMIT greatest(submit_due_schedules.max_schedules, 0)
             FOR UPDATE SKIP LOCKED LOOP
        EXIT WHEN clock_timestamp() - started > submit_due_schedules.budget;
        fields := unitvisor.cron_parse(s.cron);
        d := s.next_due;
        reached := 0;
        WHILE d IS NOT NULL AND d <= now() LOOP
            reached := reached + 1;
            latest := d;
            d := unitvisor.cron_next(fields, s.timezone,
                                     CASE WHEN reached < counted_max THEN d ELSE greatest(d, now() - late_after) END);
        END LOOP;
        on_time := latest >= now() - late_after;
        new_run := NULL;
        IF NOT on_time AND s.catch_up = 'none' THEN
            said := format('missed (%s due time(s), the latest %s old; catch_up none)', reached,
                           date_trunc('second', now() - latest));
        ELSIF s.overlap = 'skip' AND EXISTS (SELECT 1 FROM unitvisor.runs r WHERE r.id = s.last_run_id
                                                AND r.state IN ('queued', 'starting', 'running')) THEN
            said := format('skipped: run %s is still live (overlap skip)', s.last_run_id);
        ELSE
            BEGIN
                new_run := unitvisor.submit_run_spec(unitvisor.schedule_run_spec(s, latest));
                said := CASE WHEN on_time THEN 'submitted' ELSE format('submitted late, for %s missed due time(s) '
                                                                       '(catch_up one)', reached) END;
            EXCEPTION WHEN OTHERS THEN
                said := 'refused: ' || SQLERRM;
            END;
        END IF;
        UPDATE unitvisor.schedules x SET
            next_due = unitvisor.cron_next(fields, s.timezone, greatest(now(), latest)),
            last_due = latest, last_run_id = coalesce(new_run, x.last_run_id), last_result = said, last_at = now(),
            submitted = x.submitted + (new_run IS NOT NULL)::integer,
            skipped = x.skipped + (said LIKE 'skipped%')::integer,
            missed = x.missed + reached - on_time::integer
        WHERE x.name = s.name;
        schedule := s.name;
        due := latest;
        run_id := new_run;
        result := said;
        missed := reached - on_time::integer;
        RETURN NEXT;
    END LOOP;
END $$;

-- == the River source (034) ==========================================================================
--
-- A daemon with [river] configured makes River jobs into runs (docs/river.md); the statements on River's
-- own tables are in supervisor/store.py (River's schema is the daemon's configuration).

-- The run a River job becomes: `spec` is what the platform's spec function returned (submit_run's argument
-- names, as submit_run_spec takes them), river_job_id the job's id. Fenced: only a live daemon of this
-- epoch makes runs. Raises, each error naming what it refuses, when:
-- * the spec is refused by submit_run_spec or submit_run (an unknown key, a bad value);
-- * the spec sets river_job_id itself (the link is unitvisor's, never the platform's to forge);
-- * its idempotency_key names a run another submit made (that run is not this job's);
-- * no live host accepts the run (fleet_refusal's words): a run no host can place would wait for ever
--   while its River job looks done.
-- The daemon calls it in a savepoint of its claim's transaction, and on an error discards the River job
-- with the message as its error.
CREATE FUNCTION unitvisor.submit_river_run(host_id text, host_epoch bigint, spec jsonb, river_job_id bigint)
RETURNS uuid
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    new_id uuid;
    made unitvisor.runs;
    refusal text;
BEGIN
    PERFORM unitvisor.check_fence(submit_river_run.host_id, submit_river_run.host_epoch);
    IF spec IS NULL OR jsonb_typeof(spec) <> 'object' THEN
        RAISE EXCEPTION 'spec: the spec function must return a JSON object of submit_run''s argument names, not %',
            coalesce(jsonb_typeof(spec), 'NULL') USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF spec ? 'river_job_id' THEN
        RAISE EXCEPTION 'river_job_id: set by unitvisor from the River job, not by the spec function'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    new_id := unitvisor.submit_run_spec(spec || jsonb_build_object('river_job_id', submit_river_run.river_job_id));
    SELECT * INTO STRICT made FROM unitvisor.runs r WHERE r.id = new_id;
    IF made.river_job_id IS DISTINCT FROM submit_river_run.river_job_id THEN
        RAISE EXCEPTION 'idempotency_key: names run %, which another submit made; a River job makes its own run',
            new_id USING ERRCODE = 'unique_violation';
    END IF;
    refusal := unitvisor.fleet_refusal(made);
    IF refusal IS NOT NULL THEN
        RAISE EXCEPTION 'placement: the run cannot be placed: %', refusal USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    RETURN new_id;
END $$;

-- The runs linked to the River jobs river_job_ids (at most 1000 a call), for the daemon that holds
-- those jobs: each run's state, whether any attempt of it started (its unit was started: the River job
-- is then completed), and when it ended without starting, why (its last event's reason: the River job's
-- error). A job without a run has no row. Fenced.
CREATE FUNCTION unitvisor.river_runs(host_id text, host_epoch bigint, river_job_ids bigint[])
RETURNS TABLE (river_job_id bigint, run_id uuid, state text, started boolean, reason text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM unitvisor.check_fence(river_runs.host_id, river_runs.host_epoch);
    RETURN QUERY
    SELECT r.river_job_id, r.id, r.state,
           EXISTS (SELECT 1 FROM unitvisor.attempts a WHERE a.run_id = r.id AND a.started_at IS NOT NULL),
           (SELECT e.reason FROM unitvisor.run_events e WHERE e.run_id = r.id ORDER BY e.id DESC LIMIT 1)
    FROM unitvisor.runs r
    WHERE r.river_job_id = ANY (river_runs.river_job_ids[1:1000]);
END $$;

-- A River cancel of a job this host holds: cancel its run, as cancel_run does (a queued run ends
-- cancelled at once; a starting or running one is stopped by its host). Fenced. state: the run's state
-- (NULL: no run for that job); changed: whether this call asked for the cancel.
CREATE FUNCTION unitvisor.cancel_river_run(host_id text, host_epoch bigint, river_job_id bigint,
                                           OUT state text, OUT changed boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    linked uuid;
BEGIN
    PERFORM unitvisor.check_fence(cancel_river_run.host_id, cancel_river_run.host_epoch);
    SELECT r.id INTO linked FROM unitvisor.runs r WHERE r.river_job_id = cancel_river_run.river_job_id;
    IF linked IS NULL THEN
        changed := false;
        RETURN;
    END IF;
    SELECT c.state, c.changed INTO cancel_river_run.state, cancel_river_run.changed FROM unitvisor.cancel_run(linked) c;
END $$;

-- == row-level security =============================================================================
--
-- The admin (the owner) sees every row; the submitter too, through its own policies; a host sees the
-- runs it may run or settle (host_may_see says which), and the attempts, events and wait reasons of
-- exactly those runs. my_host_id() in a sub-select is evaluated once per statement, not once per row.

ALTER TABLE unitvisor.runs ENABLE ROW LEVEL SECURITY;
CREATE POLICY runs_submitter_reads ON unitvisor.runs FOR SELECT TO unitvisor_submitter USING (true);
CREATE POLICY runs_host_reads ON unitvisor.runs FOR SELECT TO unitvisor_host
    USING (unitvisor.host_may_see(host_pin, id, (SELECT unitvisor.my_host_id())));

-- A row of these is visible to a host exactly when its run is: the sub-select reads runs under the
-- policy above.
ALTER TABLE unitvisor.attempts ENABLE ROW LEVEL SECURITY;
CREATE POLICY attempts_submitter_reads ON unitvisor.attempts FOR SELECT TO unitvisor_submitter USING (true);
CREATE POLICY attempts_host_reads ON unitvisor.attempts FOR SELECT TO unitvisor_host
    USING (EXISTS (SELECT 1 FROM unitvisor.runs r WHERE r.id = attempts.run_id));

ALTER TABLE unitvisor.run_events ENABLE ROW LEVEL SECURITY;
CREATE POLICY run_events_submitter_reads ON unitvisor.run_events FOR SELECT TO unitvisor_submitter USING (true);
CREATE POLICY run_events_host_reads ON unitvisor.run_events FOR SELECT TO unitvisor_host
    USING (EXISTS (SELECT 1 FROM unitvisor.runs r WHERE r.id = run_events.run_id));

ALTER TABLE unitvisor.run_waits ENABLE ROW LEVEL SECURITY;
CREATE POLICY run_waits_submitter_reads ON unitvisor.run_waits FOR SELECT TO unitvisor_submitter USING (true);
CREATE POLICY run_waits_host_reads ON unitvisor.run_waits FOR SELECT TO unitvisor_host
    USING (EXISTS (SELECT 1 FROM unitvisor.runs r WHERE r.id = run_waits.run_id));

ALTER TABLE unitvisor.run_dependencies ENABLE ROW LEVEL SECURITY;
CREATE POLICY run_dependencies_submitter_reads ON unitvisor.run_dependencies FOR SELECT TO unitvisor_submitter
    USING (true);
-- A host sees the dependencies of the runs it may see, as their attempts and events.
CREATE POLICY run_dependencies_host_reads ON unitvisor.run_dependencies FOR SELECT TO unitvisor_host
    USING (EXISTS (SELECT 1 FROM unitvisor.runs r WHERE r.id = run_dependencies.run_id));

-- spawn_jobs: read by the submitter (every row) and by nobody else but the admin. Under a policy too,
-- so that a grant to unitvisor_host added by mistake later shows no row.
ALTER TABLE unitvisor.spawn_jobs ENABLE ROW LEVEL SECURITY;
CREATE POLICY spawn_jobs_submitter_reads ON unitvisor.spawn_jobs FOR SELECT TO unitvisor_submitter USING (true);

-- == privileges =====================================================================================
--
-- Nothing for PUBLIC; each role gets what its commands call (README, "Roles"). Both read the schema's
-- version (every command checks it), runs (a host: only those it may see, by the policies above),
-- their attempts, events and why they wait, and the hosts. Nobody but the admin reads host_roles, or
-- writes any table directly: every write is a function.

REVOKE ALL ON SCHEMA unitvisor FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA unitvisor FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA unitvisor FROM PUBLIC;
REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA unitvisor FROM PUBLIC;

GRANT USAGE ON SCHEMA unitvisor TO unitvisor_submitter, unitvisor_host;
GRANT SELECT ON unitvisor.schema_migrations, unitvisor.runs, unitvisor.attempts, unitvisor.run_events,
    unitvisor.run_waits, unitvisor.hosts, unitvisor.run_dependencies TO unitvisor_submitter, unitvisor_host;
GRANT SELECT ON unitvisor.spawn_jobs TO unitvisor_submitter;
GRANT SELECT ON unitvisor.schedules TO unitvisor_submitter;
GRANT SELECT ON unitvisor.limits TO unitvisor_submitter;

-- Both: who they are, and why a run waits (a policy's functions run with the privileges of the role that queries).
GRANT EXECUTE ON FUNCTION
    unitvisor.after_text(unitvisor.runs),
    unitvisor.cron_next(text,text,timestamp with time zone),
    unitvisor.dependency_met(text,text),
    unitvisor.failure_verdict(integer,text[],text[],boolean,integer,boolean,integer,integer,text,text),
    unitvisor.freeze_pending(unitvisor.attempts),
    unitvisor.freeze_text(unitvisor.attempts),
    unitvisor.held_text(unitvisor.runs),
    unitvisor.host_in_flight(text),
    unitvisor.host_labels(unitvisor.hosts),
    unitvisor.limit_status(),
    unitvisor.max_rows_bound(integer),
    unitvisor.my_host_id(),
    unitvisor.next_attempt_at(uuid),
    unitvisor.refusals_now(uuid[]),
    unitvisor.retention_states(),
    unitvisor.run_status(uuid),
    unitvisor.runs_with_labels(jsonb,integer),
    unitvisor.wait_reason(unitvisor.runs),
    unitvisor.whoami()
    TO unitvisor_host, unitvisor_submitter;

-- A host: every write its daemon makes, each checking that the caller is the host it writes for, and
-- what its policies call.
GRANT EXECUTE ON FUNCTION
    unitvisor.claim_jobs(text,bigint,integer,text,interval,interval),
    unitvisor.count_skips(text,bigint),
    unitvisor.declare_dead(text,bigint,double precision,integer),
    unitvisor.declare_dead_hosts(text,bigint,double precision),
    unitvisor.expire_runs(text,bigint),
    unitvisor.explain_waiting(interval,integer),
    unitvisor.fleet_upkeep_turn(text,bigint,interval),
    unitvisor.freeze_requests(text,bigint),
    unitvisor.heartbeat(text,bigint,interval,interval),
    unitvisor.host_holds_run(uuid),
    unitvisor.host_may_see(text,uuid,text),
    unitvisor.mark_host_stopped(text,bigint),
    unitvisor.mark_started(uuid,integer,text,bigint,text,timestamp with time zone,text),
    unitvisor.mark_warned(uuid,integer,text,bigint,text),
    unitvisor.prune_history(text,bigint,interval,integer),
    unitvisor.record_event(uuid,integer,text,bigint,text,text),
    unitvisor.record_freeze(text,bigint,uuid,integer,timestamp with time zone,text,text),
    unitvisor.record_outcome(uuid,integer,text,bigint,text,text,text,text,interval,text,timestamp with time zone,timestamp with time zone),
    unitvisor.record_outcome(uuid,integer,text,bigint,text,text,text,text,interval,text,timestamp with time zone,timestamp with time zone,bigint,bigint,bigint,bigint),
    unitvisor.record_outcome(uuid,integer,text,bigint,text,text,text,text,interval,text,timestamp with time zone,timestamp with time zone,bigint,bigint,bigint,bigint,timestamp with time zone),
    unitvisor.record_outcome(uuid,integer,text,bigint,text,text,text,text,interval,text,timestamp with time zone,timestamp with time zone,bigint,bigint,bigint,bigint,timestamp with time zone,bigint),
    unitvisor.record_output_tails(text,bigint,uuid[],integer[],text[]),
    unitvisor.register_host(text,text,text,integer,bigint,text,text,text[],text[],text,text[],boolean,text,double precision,double precision),
    unitvisor.register_host_allowlist(text,bigint,text[],text[],text[]),
    unitvisor.register_host_environment(text,bigint,text[],text[]),
    unitvisor.register_host_labels(text,bigint,jsonb),
    unitvisor.register_wake_channel(text,bigint),
    unitvisor.renew_heartbeat(text,bigint),
    unitvisor.set_host_pressure(text,bigint,text,text,jsonb,text),
    unitvisor.set_host_state(text,text),
    unitvisor.submit_due_schedules(text,bigint,integer,interval),
    unitvisor.unit_owners(text[])
    TO unitvisor_host;

-- A River host (034, docs/river.md): its login role is a member of unitvisor_river too, granted by the
-- admin to the hosts that serve a River source only. submit_river_run creates runs, which a plain host
-- role may not (README, Roles).
GRANT EXECUTE ON FUNCTION
    unitvisor.submit_river_run(text,bigint,jsonb,bigint),
    unitvisor.river_runs(text,bigint,bigint[]),
    unitvisor.cancel_river_run(text,bigint,bigint)
    TO unitvisor_river;

-- The submitter: its API (docs/sql-api.md).
GRANT EXECUTE ON FUNCTION
    unitvisor.cancel_run(uuid),
    unitvisor.drop_limit(text),
    unitvisor.freeze_run(uuid),
    unitvisor.hold_run(uuid),
    unitvisor.release_run(uuid),
    unitvisor.resume_run(uuid),
    unitvisor.set_limit(text,jsonb,integer),
    unitvisor.resume_run(uuid,boolean),
    unitvisor.create_schedule(text,text,text,jsonb,text,text),
    unitvisor.drop_schedule(text),
    unitvisor.pause_schedule(text,boolean),
    unitvisor.submit_run_spec(jsonb),
    unitvisor.submit_run(text[],jsonb,text,text,bigint,integer,integer,integer,bigint,integer,text,integer,integer,integer,text[],boolean,text,jsonb,text,timestamp with time zone,timestamp with time zone,bigint,text,integer,integer,text,text[],boolean,integer,boolean,integer,jsonb,boolean,bigint,uuid[],text),
    unitvisor.thaw_run(uuid)
    TO unitvisor_submitter;

-- == the migrations this file holds =================================================================
--
-- A database made from this file is at this migration; `unitvisor migrate` applies any later one on
-- top. Add a migration's name here when its change is folded in above.
INSERT INTO unitvisor.schema_migrations (version) VALUES
    ('001_schema'),
    ('002_fleet'),
    ('003_run_policy'),
    ('004_roles'),
    ('005_sql_api'),
    ('006_lifecycle'),
    ('007_outcome_record'),
    ('008_retention'),
    ('009_claim_cost'),
    ('010_wake_targets'),
    ('011_commit_wake_cost'),
    ('012_expiry_owner'),
    ('013_fleet_promises'),
    ('014_host_reads'),
    ('015_run_privilege'),
    ('017_accounting'),
    ('018_admission_pressure'),
    ('019_fleet_upkeep'),
    ('020_claim_gate'),
    ('021_operator'),
    ('022_argument_checks'),
    ('023_refusals_now'),
    ('024_drain_through_stop'),
    ('026_graceful_stop'),
    ('027_failure_rules'),
    ('028_schedules'),
    ('029_heartbeat_cost'),
    ('030_hold_freeze'),
    ('032_concurrency_limits'),
    ('033_placement'),
    ('034_river'),
    ('035_dependencies'),
    ('036_fleet_silent'),
    ('037_cached_plans'),
    ('038_wake_for_work'),
    ('039_claim_under_contention'),
    ('040_upkeep_looked_at'),
    ('041_heartbeat_work_mark'),
    ('042_explain_when_changed'),
    ('043_marks_leave_out_explanations'),
    ('044_late_return_is_a_disruption'),
    ('045_host_check_planned_once'),
    ('046_claims_take_a_slot'),
    ('047_fresh_jobs_left_to_the_woken'),
    ('048_named_hosts_told_alone'),
    ('049_claim_slot_before_the_fence'),
    ('050_claims_wait_longer_for_a_slot');

-- unitvisor schema: a run gets no more than it needs (issue 21): environment names by an allowlist,
-- and the size of every text argument of submit_run bounded.
--
-- Expand only, for 0.5.x daemons and CLIs: two columns added to hosts (which every release reads by
-- explicit column lists), two functions added, three replaced in place with the same names, arguments
-- and results (refused_environment_name, register_host_environment, submit_run).

-- -- environment names: an allowlist --------------------------------------------------------------
--
-- Until now a host registered the names it refuses (environment_denied, supervisor/envpolicy.py) and
-- the refused ones it opens anyway (environment_allowed), and every other name passed: TAR_OPTIONS,
-- GIT_CONFIG_*, RSYNC_RSH, LUA_INIT, MAKEFLAGS, LESSOPEN, DOTNET_STARTUP_HOOKS, OPENSSL_CONF and the
-- like made an allowed program run the submitter's code. Now a 0.6 daemon registers the names its
-- [runs] allowed_environment opens: plain names (environment_names, compared with =) and patterns
-- (environment_patterns, anchored regexes from supervisor/globs.py). A name is allowed when it is one
-- of the plain names, or when a pattern matches it and it is not on the denylist (environment_denied,
-- still registered): a name that loads code (LD_*, PYTHON*, PATH, ...) is opened only by its exact name.
--
-- A host whose daemon registered no allowlist (environment_patterns NULL: a 0.5.x daemon, or any
-- before it) keeps today's rule, its denylist, until it is upgraded. Chosen over refusing such a host
-- every name outside a default set, because the README's Upgrade promises that the previous release
-- keeps working between `migrate` and each host's upgrade, and that daemon's own check (unitspec.py
-- of 0.5.x) refuses by its denylist too, so the claim and the start agree; the hole stays open on a
-- host only until it runs 0.6 (README, Upgrade, says to upgrade every host).
ALTER TABLE unitvisor.hosts
    ADD COLUMN environment_names text[],
    ADD COLUMN environment_patterns text[];

-- As in 003, the first of r's environment names that host h refuses, or NULL, by the rule above. Still
-- the one function host_refusal asks (the claim, the probe and the explanation of a waiting run).
CREATE OR REPLACE FUNCTION unitvisor.refused_environment_name(h unitvisor.hosts, r unitvisor.runs) RETURNS text
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
REVOKE EXECUTE ON FUNCTION unitvisor.register_host_allowlist(text, bigint, text[], text[], text[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.register_host_allowlist(text, bigint, text[], text[], text[]) TO unitvisor_host;

-- As in 003 (what a 0.5.x daemon calls), and it also clears an allowlist a 0.6 daemon registered for
-- the same host id: after a downgrade the host is judged by the denylist its daemon enforces, never by
-- a list that daemon does not know.
CREATE OR REPLACE FUNCTION unitvisor.register_host_environment(host_id text, host_epoch bigint,
    environment_denied text[], environment_allowed text[]) RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    UPDATE unitvisor.hosts h SET environment_denied = register_host_environment.environment_denied,
        environment_allowed = register_host_environment.environment_allowed,
        environment_names = NULL, environment_patterns = NULL
    WHERE h.id = register_host_environment.host_id
      AND unitvisor.check_fence(register_host_environment.host_id, register_host_environment.host_epoch)
$$;

-- -- sizes: every text argument of submit_run bounded ----------------------------------------------
--
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
-- * retry_on at most 8 elements: there are 8 outcomes worth a retry.
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
    IF cardinality(check_run_sizes.retry_on) > 8 THEN
        RAISE EXCEPTION 'retry_on: % elements, over the limit of 8 (each outcome once)',
            cardinality(check_run_sizes.retry_on) USING ERRCODE = 'invalid_parameter_value';
    END IF;
END $$;
REVOKE EXECUTE ON FUNCTION unitvisor.check_run_sizes(text[], jsonb, text, text, text[]) FROM PUBLIC;

-- As in 006, and calling check_run_sizes once every argument has its form. Same signature, so its
-- grants stay; SECURITY DEFINER and the search_path are said again, as CREATE OR REPLACE sets them anew.
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
    start_deadline        timestamptz DEFAULT NULL
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
            concurrency_key, not_before, start_deadline)
        VALUES (submit_run.argv, env, submit_run.working_directory,
            submit_run.run_user, submit_run.memory_max, submit_run.cpu_quota_percent, submit_run.tasks_max,
            submit_run.io_weight, submit_run.runtime_max_sec, submit_run.max_attempts, submit_run.host_pin,
            submit_run.priority, submit_run.retry_backoff_sec, submit_run.retry_backoff_max_sec,
            submit_run.retry_on, coalesce(submit_run.private_network, false), submit_run.idempotency_key,
            run_labels, submit_run.concurrency_key, submit_run.not_before, submit_run.start_deadline)
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

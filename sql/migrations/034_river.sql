-- unitvisor schema 34 (issue 26): a River source. A daemon with [river] configured claims River jobs
-- (riverqueue/river's river_job table, in the platform's own schema) with River's own semantics and
-- makes each one a unitvisor run, in the claim's transaction (supervisor/store.py holds those
-- statements: River's schema is named by the daemon's configuration, so they cannot live here).
-- This migration is unitvisor's side of the link:
--
-- * runs.river_job_id: the River job a run was made from; at most one run per River job (a unique
--   index), so that a job is never made into two runs, whatever happens between claim and finish.
-- * submit_run: river_job_id, last and defaulted (DROP and CREATE: the signature changes; grants again).
-- * submit_river_run: what the daemon calls with the platform's spec function's result: submit_run_spec
--   with river_job_id added, then refused when no live host accepts the run (River's job is then
--   discarded with that reason, as the platform's own worker would have failed it).
-- * river_runs: the linked runs of River jobs the daemon holds, and whether each started, for the
--   finish pass (completed once started; discarded when the run ended without starting).
-- * cancel_river_run: a River cancel (metadata.cancel_attempted_at) of a job the daemon holds cancels
--   its run.
-- * unitvisor_river: a new NOLOGIN role, the only one granted those three functions. submit_river_run
--   creates a run from a spec its caller computed, which a plain host role may not do (README, Roles: "a
--   host role cannot create runs"): the admin grants unitvisor_river to the login roles of the hosts that
--   serve a River source only (GRANT unitvisor_river TO <host login>), so that a fleet without River keeps
--   that promise and a River host's wider trust is one it was given by name (docs/river.md, Privileges).
-- * create_schedule refuses river_job_id in a schedule's run, as it refuses idempotency_key: the link
--   is the River source's, and one River job makes one run while a schedule makes many.
--
-- Expand only, for 0.8.0 daemons and CLIs: a new nullable column (0.8.0 reads rows by explicit column
-- lists), new functions, and submit_run one more argument, last and defaulted.
--
-- Creates a role: the login role that migrates must be able to create roles (as for 004), unless
-- unitvisor_river exists already (CREATE ROLE unitvisor_river NOLOGIN, run once per cluster beforehand).

-- -- the River hosts' role -----------------------------------------------------------------------------

-- As 004 creates its roles: the cluster's, idempotent, and a concurrent migrate of another database of
-- the cluster is no error. store.migrate runs this file as unitvisor_admin (SET LOCAL ROLE), which may
-- not create roles: the role is created as the login role that migrates, then the admin's again.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles r WHERE r.rolname = 'unitvisor_river') THEN
        RESET ROLE;
        BEGIN
            CREATE ROLE unitvisor_river NOLOGIN;
        EXCEPTION
            WHEN duplicate_object OR unique_violation THEN
                NULL;  -- created meanwhile by a migrate in another database
            WHEN insufficient_privilege THEN
                RAISE EXCEPTION 'migration 034 creates the role unitvisor_river, which % may not do: migrate as a '
                                'role that may create roles (a superuser, or CREATEROLE), or create it first '
                                '(CREATE ROLE unitvisor_river NOLOGIN)', session_user
                    USING ERRCODE = 'insufficient_privilege';
        END;
        SET LOCAL ROLE unitvisor_admin;
    END IF;
END $$;

-- -- the link -----------------------------------------------------------------------------------------

ALTER TABLE unitvisor.runs
    -- The River job this run was made from (NULL: submitted otherwise). River's ids are bigserial.
    ADD COLUMN river_job_id bigint CONSTRAINT runs_river_job_id_valid CHECK (river_job_id > 0);

-- One run per River job: a second claim of the same job (a bug, or a River job reset to available by
-- hand) cannot make a second run; its transaction fails instead, and the job stays as it was.
CREATE UNIQUE INDEX runs_river_job_id_once ON unitvisor.runs (river_job_id) WHERE river_job_id IS NOT NULL;

-- -- submit_run: river_job_id -------------------------------------------------------------------------
--
-- As in 033, with river_job_id last and defaulted.
DROP FUNCTION unitvisor.submit_run(text[], jsonb, text, text, bigint, integer, integer, integer,
    bigint, integer, text, integer, integer, integer, text[], boolean, text, jsonb, text, timestamptz,
    timestamptz, bigint, text, integer, integer, text, text[], boolean, integer, boolean, integer, jsonb, boolean);
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
    river_job_id          bigint  DEFAULT NULL
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

    -- A constraint this function did not foresee (one added later) must not leak the row either:
    -- caught, and raised again with its name but without the DETAIL that holds the row.
    BEGIN
        INSERT INTO unitvisor.runs (argv, environment, working_directory, run_user, memory_max,
            cpu_quota_percent, tasks_max, io_weight, runtime_max_sec, max_attempts, host_pin, priority,
            retry_backoff_sec, retry_backoff_max_sec, retry_on, private_network, idempotency_key, labels,
            concurrency_key, not_before, start_deadline, memory_high,
            stop_signal, stop_timeout, warn_before, warn_signal, fail_on, count_lost, max_lost_attempts,
            held_at, held_by, concurrency_limit, host_labels, avoid_failed_host, river_job_id)
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
            submit_run.avoid_failed_host, submit_run.river_job_id)
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
        IF NOT coalesce(submit_run.hold, false) THEN
            INSERT INTO unitvisor.spawn_jobs (run_id, priority, scheduled_at)
            VALUES (new_id, submit_run.priority, greatest(now(), submit_run.not_before));
        END IF;
        INSERT INTO unitvisor.run_events (run_id, state, reason)
        VALUES (new_id, 'queued', CASE WHEN coalesce(submit_run.hold, false) THEN 'submitted, held by ' || session_user
                                       ELSE 'submitted' END);
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
    bigint, integer, text, integer, integer, integer, text[], boolean, text, jsonb, text, timestamptz,
    timestamptz, bigint, text, integer, integer, text, text[], boolean, integer, boolean, integer, jsonb, boolean, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.submit_run(text[], jsonb, text, text, bigint, integer, integer, integer,
    bigint, integer, text, integer, integer, integer, text[], boolean, text, jsonb, text, timestamptz,
    timestamptz, bigint, text, integer, integer, text, text[], boolean, integer, boolean, integer, jsonb, boolean, bigint) TO unitvisor_submitter;

-- -- the River source's functions ---------------------------------------------------------------------

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

REVOKE EXECUTE ON FUNCTION unitvisor.submit_river_run(text, bigint, jsonb, bigint),
    unitvisor.river_runs(text, bigint, bigint[]), unitvisor.cancel_river_run(text, bigint, bigint) FROM PUBLIC;
-- To unitvisor_river, not unitvisor_host: a River host's login role is a member of both (its fence is
-- still checked against session_user, as for every host write).
GRANT EXECUTE ON FUNCTION unitvisor.submit_river_run(text, bigint, jsonb, bigint),
    unitvisor.river_runs(text, bigint, bigint[]), unitvisor.cancel_river_run(text, bigint, bigint) TO unitvisor_river;

-- -- create_schedule: river_job_id refused -----------------------------------------------------------
--
-- As in 028, with river_job_id among the keys a schedule's run may not have (same signature: its grants stay).
-- Create a schedule; returns its first due time. Each argument is checked, in order, with an error
-- (SQLSTATE 22023, or submit_run's own for the run) whose message starts with the argument's name.
CREATE OR REPLACE FUNCTION unitvisor.create_schedule(name text, cron text, timezone text, run jsonb,
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

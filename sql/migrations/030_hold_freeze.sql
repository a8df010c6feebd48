-- unitvisor schema 30 (issue 25, item 6): hold a queued run, freeze a running one.
--
-- Hold: a held run stays queued but is never claimed, until it is released. It holds no spawn job
-- while held (hold_run removes it, release_run makes a new one, submit_run with hold => true makes
-- none), so nothing that claims or looks for work changes: claim_jobs, host_has_work (the heartbeat's
-- claimable) and key_head_jobs only ever see available jobs. A held run at the head of its
-- concurrency key keeps its place and blocks the key: the runs behind it wait for it as they wait for
-- any earlier queued run of their key (a key means "one at a time, in submission order"; a later run
-- overtaking a held one would break the order the submitter asked for). Release it, or cancel it, to
-- let the key go on. A held run still expires at its start deadline, if it has one.
--
-- Freeze: the operator's request is a row change the owning daemon acts on (the CLI may run on any
-- host): freeze_run/thaw_run write the request on the run's open attempt and NOTIFY unitvisor_cancel,
-- which every daemon already listens to; the owning daemon reads its pending requests
-- (freeze_requests), calls systemd's FreezeUnit/ThawUnit and records what happened (record_freeze),
-- refusal included (a cgroup v1 host cannot freeze). The heartbeat's `cancels` is also true while a
-- request of the host is pending, so a lost notification is made up for at the next poll.
--
-- Expand only, for 0.8.0 daemons and CLIs: new nullable columns (0.8.0 reads rows by explicit column
-- lists), new functions, and submit_run one more argument, last and defaulted (DROP and CREATE: the
-- signature changes; grants again). heartbeat, wait_reason, waited_for and resume_run keep their
-- signatures and results (replaced in place). A 0.8.0 daemon does not act on a freeze request: it
-- stays pending (`show` says so) until the host runs this release; its heartbeat then wakes its cancel
-- pass each poll, which finds nothing to cancel (one query).

-- -- columns ------------------------------------------------------------------------------------------

ALTER TABLE unitvisor.runs
    -- While held (queued only): since when, and by which login role. NULL: not held.
    ADD COLUMN held_at timestamptz,
    ADD COLUMN held_by text;

ALTER TABLE unitvisor.attempts
    -- The operator's last freeze request on this attempt's unit: 'frozen' or 'thawed', when, by whom.
    ADD COLUMN freeze_wanted text,
    ADD COLUMN freeze_requested_at timestamptz,
    ADD COLUMN freeze_requested_by text,
    -- What the host last did: the unit's freezer state after it ('frozen' or 'thawed'), why the
    -- request was refused (NULL: done), when, and which request it answered (its freeze_requested_at):
    -- a request is pending while freeze_requested_at is not the one answered.
    ADD COLUMN freeze_state text,
    ADD COLUMN freeze_refused text,
    ADD COLUMN freeze_acted_at timestamptz,
    ADD COLUMN freeze_acted_on timestamptz;

-- -- hold ---------------------------------------------------------------------------------------------

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
-- any queued run. A backoff it was waiting out when it was held is not waited out again: releasing is
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
    RETURNING r.priority, r.not_before INTO released;
    IF NOT FOUND THEN
        SELECT r.state INTO release_run.state FROM unitvisor.runs r WHERE r.id = release_run.run_id;
        changed := false;
        RETURN;
    END IF;
    INSERT INTO unitvisor.spawn_jobs AS j (run_id, priority, scheduled_at)
    VALUES (release_run.run_id, released.priority, greatest(now(), released.not_before))
    ON CONFLICT (run_id) WHERE state = 'available' DO NOTHING;
    INSERT INTO unitvisor.run_events (run_id, state, reason)
    VALUES (release_run.run_id, 'queued', 'released by ' || session_user);
    release_run.state := 'queued';
    changed := true;
END $$;

-- wait_reason as in 006, a held run first: nothing else matters while it is held.
CREATE OR REPLACE FUNCTION unitvisor.wait_reason(r unitvisor.runs) RETURNS text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE WHEN r.state <> 'queued' THEN NULL
                WHEN r.held_at IS NOT NULL THEN unitvisor.held_text(r)
                WHEN r.not_before > now() THEN format('not before %s',
                    to_char(r.not_before AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS "UTC"'))
                ELSE (SELECT w.reason FROM unitvisor.run_waits w WHERE w.run_id = r.id) END
$$;

-- waited_for as in 013, a held run first (the reason of its expiry).
CREATE OR REPLACE FUNCTION unitvisor.waited_for(r unitvisor.runs) RETURNS text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT coalesce(
        'its release: ' || unitvisor.held_text(r),
        (SELECT 'run ' || b.id || ' (' || b.state || ') with the same concurrency key'
         FROM unitvisor.runs b WHERE b.id = unitvisor.concurrency_blocker(r)),
        unitvisor.fleet_refusal(r),
        (SELECT format('%s attempt(s), none of which started; the last: %s', count(*),
                       (SELECT coalesce(l.outcome, 'open') || coalesce(' (' || l.reason || ')', '')
                        FROM unitvisor.attempts l WHERE l.run_id = r.id ORDER BY l.attempt DESC LIMIT 1))
         FROM unitvisor.attempts a WHERE a.run_id = r.id HAVING count(*) > 0),
        'a host to claim it')
$$;

-- resume_run as in 006, and a hold left on the run when it ended (a held run cancelled or expired) is
-- dropped: resuming is the operator's decision to run it, and its new job must not be claimed while
-- the run says it is held.
CREATE OR REPLACE FUNCTION unitvisor.resume_run(run_id uuid, OUT state text, OUT changed boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    resumed record;
BEGIN
    UPDATE unitvisor.runs r SET state = 'queued', cancel_requested_at = NULL, finished_at = NULL, updated_at = now(),
        start_deadline = CASE WHEN r.start_deadline <= now() THEN NULL ELSE r.start_deadline END,
        held_at = NULL, held_by = NULL
    FROM (SELECT o.id, o.start_deadline FROM unitvisor.runs o WHERE o.id = resume_run.run_id FOR UPDATE) old
    WHERE r.id = old.id AND r.state IN ('failed', 'cancelled', 'expired')
    RETURNING r.priority, r.not_before, old.start_deadline AS old_deadline, r.start_deadline AS new_deadline
    INTO resumed;
    IF NOT FOUND THEN
        SELECT r.state INTO resume_run.state FROM unitvisor.runs r WHERE r.id = resume_run.run_id;
        changed := false;
        RETURN;
    END IF;
    -- A job left behind by an older race is the job this run needs: keep it, never fail on it.
    INSERT INTO unitvisor.spawn_jobs AS j (run_id, priority, scheduled_at)
    VALUES (resume_run.run_id, resumed.priority, greatest(now(), resumed.not_before))
    ON CONFLICT (run_id) WHERE state = 'available' DO NOTHING;
    INSERT INTO unitvisor.run_events (run_id, state, reason)
    VALUES (resume_run.run_id, 'queued', 'resumed by an operator' ||
            CASE WHEN resumed.old_deadline IS DISTINCT FROM resumed.new_deadline
                 THEN format('; its start deadline %s has passed and no longer applies',
                             to_char(resumed.old_deadline AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS "UTC"'))
                 ELSE '' END);
    resume_run.state := 'queued';
    changed := true;
END $$;

-- -- submit_run: hold ---------------------------------------------------------------------------------
--
-- As in 027, with hold last and defaulted: a run submitted held is queued without a spawn job, and its
-- first event says so. DROP and CREATE (the signature changes), then the grants again, as 017 did.
DROP FUNCTION unitvisor.submit_run(text[], jsonb, text, text, bigint, integer, integer, integer, bigint,
    integer, text, integer, integer, integer, text[], boolean, text, jsonb, text, timestamptz, timestamptz, bigint,
    text, integer, integer, text, text[], boolean, integer);
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
    hold                  boolean DEFAULT false
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
            stop_signal, stop_timeout, warn_before, warn_signal, fail_on, count_lost, max_lost_attempts,
            held_at, held_by)
        VALUES (submit_run.argv, env, submit_run.working_directory,
            submit_run.run_user, submit_run.memory_max, submit_run.cpu_quota_percent, submit_run.tasks_max,
            submit_run.io_weight, submit_run.runtime_max_sec, submit_run.max_attempts, submit_run.host_pin,
            submit_run.priority, submit_run.retry_backoff_sec, submit_run.retry_backoff_max_sec,
            retry_rules, coalesce(submit_run.private_network, false), submit_run.idempotency_key,
            run_labels, submit_run.concurrency_key, submit_run.not_before, submit_run.start_deadline,
            submit_run.memory_high,
            run_stop_signal, submit_run.stop_timeout, submit_run.warn_before, run_warn_signal,
            fail_rules, submit_run.count_lost, submit_run.max_lost_attempts,
            CASE WHEN submit_run.hold THEN now() END, CASE WHEN submit_run.hold THEN session_user END)
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
    timestamptz, bigint, text, integer, integer, text, text[], boolean, integer, boolean) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.submit_run(text[], jsonb, text, text, bigint, integer, integer, integer,
    bigint, integer, text, integer, integer, integer, text[], boolean, text, jsonb, text, timestamptz,
    timestamptz, bigint, text, integer, integer, text, text[], boolean, integer, boolean) TO unitvisor_submitter;

-- -- freeze -------------------------------------------------------------------------------------------

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
    PERFORM pg_notify('unitvisor_cancel', request_freeze.run_id::text);
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

-- heartbeat as in 029 (with 028's schedule flag), its `cancels` also true while a freeze request of this host waits: the poll
-- that makes up for a lost notification (a 0.8.0 daemon then looks for cancels, and finds none).
CREATE OR REPLACE FUNCTION unitvisor.heartbeat(host_id text, host_epoch bigint, waited interval)
RETURNS TABLE (host_state text, claimable boolean, cancels boolean, upkeep boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM unitvisor.require_host(heartbeat.host_id);
    RETURN QUERY
    UPDATE unitvisor.hosts h SET heartbeat_at = now()
    WHERE h.id = heartbeat.host_id AND h.epoch = heartbeat.host_epoch AND h.state <> 'dead'
    RETURNING h.state,
        unitvisor.host_has_work(h),
        EXISTS (SELECT 1 FROM unitvisor.attempts a JOIN unitvisor.runs r ON r.id = a.run_id
                WHERE a.host_id = heartbeat.host_id AND a.outcome IS NULL
                  AND (r.cancel_requested_at IS NOT NULL OR unitvisor.freeze_pending(a))),
        -- The turn first: while it is not due, the looks below are not made.
        ((SELECT u.turn_at FROM unitvisor.fleet_upkeep u) <= now() - make_interval(secs => coalesce(h.poll_interval_sec, 10))
         AND (EXISTS (SELECT 1 FROM unitvisor.hosts o WHERE o.id <> h.id AND unitvisor.host_is_overdue(o))
              OR EXISTS (SELECT 1 FROM unitvisor.spawn_jobs j
                         WHERE j.state = 'available' AND j.scheduled_at <= now() - heartbeat.waited)
              OR EXISTS (SELECT 1 FROM unitvisor.runs r
                         WHERE r.state = 'queued' AND r.start_deadline <= now() AND unitvisor.is_overdue(r))))
        OR EXISTS (SELECT 1 FROM unitvisor.schedules s WHERE NOT s.paused AND s.next_due <= now());
END $$;

-- -- grants -------------------------------------------------------------------------------------------

REVOKE EXECUTE ON FUNCTION unitvisor.held_text(unitvisor.runs), unitvisor.hold_run(uuid), unitvisor.release_run(uuid),
    unitvisor.freeze_pending(unitvisor.attempts), unitvisor.request_freeze(uuid, text), unitvisor.freeze_run(uuid),
    unitvisor.thaw_run(uuid), unitvisor.freeze_text(unitvisor.attempts), unitvisor.freeze_requests(text, bigint),
    unitvisor.record_freeze(text, bigint, uuid, integer, timestamptz, text, text) FROM PUBLIC;
-- wait_reason (granted to both) calls held_text with the caller's rights; freeze_text is for reading.
GRANT EXECUTE ON FUNCTION unitvisor.held_text(unitvisor.runs), unitvisor.freeze_pending(unitvisor.attempts),
    unitvisor.freeze_text(unitvisor.attempts) TO unitvisor_submitter, unitvisor_host;
GRANT EXECUTE ON FUNCTION unitvisor.hold_run(uuid), unitvisor.release_run(uuid), unitvisor.freeze_run(uuid),
    unitvisor.thaw_run(uuid) TO unitvisor_submitter;
GRANT EXECUTE ON FUNCTION unitvisor.freeze_requests(text, bigint),
    unitvisor.record_freeze(text, bigint, uuid, integer, timestamptz, text, text) TO unitvisor_host;

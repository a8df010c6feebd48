-- unitvisor schema, version 6: when a run may start (issue 13, second part).
--
-- * concurrency_key: runs that share a key never run at the same time anywhere in the fleet; the
--   later ones wait, in submission order.
-- * not_before: the run's first start is not before this time.
-- * start_deadline: a run that has not started by then ends as `expired`, a new terminal state.
--
-- Expand only, for the previous release (0.3.0): runs gains three nullable columns (0.3.0 reads runs by
-- explicit column lists), submit_run three arguments, last and defaulted (0.3.0's CLI calls it with
-- named arguments), and the functions 0.3.0 calls keep their signatures (claim_jobs, resume_run,
-- explain_waiting, run_status): their new bodies apply the new rules to old daemons' claims too. What a
-- 0.3.0 daemon does not do is call expire_runs, and its CLI does not know `expired` (README, Upgrade).

-- -- the columns and their rules --------------------------------------------------------------------
--
-- The constraints are added NOT VALID and validated by `unitvisor migrate` after this transaction
-- commits, as in 005 (see there): the scans of runs run without this migration's ACCESS EXCLUSIVE lock.

ALTER TABLE unitvisor.runs
    ADD COLUMN concurrency_key text,
    ADD COLUMN not_before timestamptz,
    ADD COLUMN start_deadline timestamptz,
    -- As idempotency_key: the caller's own string, bounded, one line.
    ADD CONSTRAINT runs_concurrency_key_valid CHECK (
        concurrency_key IS NULL OR (length(concurrency_key) BETWEEN 1 AND 255 AND concurrency_key !~ '[[:cntrl:]]')) NOT VALID,
    -- 'infinity' is no time: a not_before of infinity would never start, a deadline of infinity is none.
    ADD CONSTRAINT runs_not_before_valid CHECK (not_before IS NULL OR isfinite(not_before)) NOT VALID,
    ADD CONSTRAINT runs_start_deadline_valid CHECK (
        start_deadline IS NULL OR (isfinite(start_deadline) AND (not_before IS NULL OR start_deadline > not_before))) NOT VALID;

-- expired: a terminal state beside succeeded, failed and cancelled (a swap of the closed vocabulary, as
-- 001 planned for). Every existing row satisfies the new list.
ALTER TABLE unitvisor.runs DROP CONSTRAINT runs_state_valid;
ALTER TABLE unitvisor.runs ADD CONSTRAINT runs_state_valid CHECK (state IN
    ('queued', 'starting', 'running', 'succeeded', 'failed', 'cancelled', 'expired')) NOT VALID;

-- The last line of defence of "one live run per key": whatever the claim's lock and checks miss, two
-- runs of one key can never be starting or running at once. Also the claim's look-up of a live run.
CREATE UNIQUE INDEX runs_one_live_per_key_idx ON unitvisor.runs (concurrency_key)
    WHERE state IN ('starting', 'running') AND concurrency_key IS NOT NULL;
-- The claim's look-up of an earlier queued run of the same key: a backward range scan that stops at
-- the first row.
CREATE INDEX runs_queued_key_idx ON unitvisor.runs (concurrency_key, created_at, id)
    WHERE state = 'queued' AND concurrency_key IS NOT NULL;
-- expire_runs' scan: queued runs with a deadline, by deadline. Empty when nobody uses deadlines, so a
-- pass with nothing to do is one index probe.
CREATE INDEX runs_start_deadline_idx ON unitvisor.runs (start_deadline)
    WHERE state = 'queued' AND start_deadline IS NOT NULL;

-- -- one live run per key ---------------------------------------------------------------------------

-- The run r waits for because of its concurrency key, or NULL: a run of its key that is starting or
-- running, else the queued run of its key submitted just before it (order: created_at, then id). A
-- queued retry keeps its place (it is still queued, with its first submission's created_at), so the
-- runs behind it wait until it has no attempt left; so does a resumed run. Read with the rights of the
-- caller: only the SECURITY DEFINER functions below call it, and they see every run.
CREATE FUNCTION unitvisor.concurrency_blocker(r unitvisor.runs) RETURNS uuid
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE WHEN r.concurrency_key IS NOT NULL THEN coalesce(
        (SELECT k.id FROM unitvisor.runs k
         WHERE k.concurrency_key = r.concurrency_key AND k.state IN ('starting', 'running') AND k.id <> r.id
         LIMIT 1),
        (SELECT k.id FROM unitvisor.runs k
         WHERE k.concurrency_key = r.concurrency_key AND k.state = 'queued'
           AND (k.created_at, k.id) < (r.created_at, r.id)
         ORDER BY k.created_at DESC, k.id DESC LIMIT 1)) END
$$;
REVOKE EXECUTE ON FUNCTION unitvisor.concurrency_blocker(unitvisor.runs) FROM PUBLIC;

-- Whether r is past its start deadline without ever having started (no attempt of it recorded a
-- start; one that failed to start, or was refused, did not). A run that started once is never expired:
-- its retries go on as its max_attempts says.
CREATE FUNCTION unitvisor.is_overdue(r unitvisor.runs) RETURNS boolean
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT r.state = 'queued' AND r.start_deadline <= now()
       AND NOT EXISTS (SELECT 1 FROM unitvisor.attempts a WHERE a.run_id = r.id AND a.started_at IS NOT NULL)
$$;
REVOKE EXECUTE ON FUNCTION unitvisor.is_overdue(unitvisor.runs) FROM PUBLIC;

-- -- expiry -----------------------------------------------------------------------------------------

-- What queued run r is waiting for, in words, for the reason of its expiry: the run of its key, why no
-- live host accepts it (as explain_waiting says it, but as of now), or its attempts that never started.
CREATE FUNCTION unitvisor.waited_for(r unitvisor.runs) RETURNS text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT coalesce(
        (SELECT 'run ' || b.id || ' (' || b.state || ') with the same concurrency key'
         FROM unitvisor.runs b WHERE b.id = unitvisor.concurrency_blocker(r)),
        unitvisor.fleet_refusal(r),
        (SELECT format('%s attempt(s), none of which started; the last: %s', count(*),
                       (SELECT coalesce(l.outcome, 'open') || coalesce(' (' || l.reason || ')', '')
                        FROM unitvisor.attempts l WHERE l.run_id = r.id ORDER BY l.attempt DESC LIMIT 1))
         FROM unitvisor.attempts a WHERE a.run_id = r.id HAVING count(*) > 0),
        'a host to claim it')
$$;
REVOKE EXECUTE ON FUNCTION unitvisor.waited_for(unitvisor.runs) FROM PUBLIC;

-- Expire every overdue run (is_overdue) that nobody is claiming, expiring or cancelling right now:
-- its available job is removed, the run becomes expired (finished), and an event says by which
-- deadline and what it was waiting for. Locks as the claim and cancel_run do, job first, then run,
-- and never waits for either (SKIP LOCKED): a run being claimed this very moment was claimed in time,
-- and one skipped here is met by the next pass. Returns how many runs it expired. Not granted: called
-- by expire_runs and claim_jobs, which run as their owner.
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
REVOKE EXECUTE ON FUNCTION unitvisor.expire_overdue_runs(integer) FROM PUBLIC;

-- The daemons' call, in their fleet upkeep: any live host may expire any run, as any may explain why
-- one waits, so that a run no host could ever claim still expires.
CREATE FUNCTION unitvisor.expire_runs(host_id text, host_epoch bigint) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM unitvisor.check_fence(expire_runs.host_id, expire_runs.host_epoch);
    RETURN unitvisor.expire_overdue_runs();
END $$;
REVOKE EXECUTE ON FUNCTION unitvisor.expire_runs(text, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.expire_runs(text, bigint) TO unitvisor_host;

-- The completion signal (005) for the new terminal state too.
DROP TRIGGER runs_notify_finished ON unitvisor.runs;
CREATE TRIGGER runs_notify_finished AFTER UPDATE OF state ON unitvisor.runs
    FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state AND NEW.state IN ('succeeded', 'failed', 'cancelled', 'expired'))
    EXECUTE FUNCTION unitvisor.notify_run_finished();

-- -- the claim --------------------------------------------------------------------------------------

-- claim_jobs as in 002 (and 004's SECURITY DEFINER), with three more rules:
-- * Overdue runs are expired first (expire_overdue_runs), so that a claim never starts a run past its
--   start deadline, and hosts of the previous release, which do not call expire_runs, expire them too.
-- * not_before needs nothing here: the first spawn job is scheduled at it, and only due jobs are taken.
-- * A run with a concurrency key is taken only when concurrency_blocker finds no run it waits for. Two
--   claims on two hosts can each have read that from a snapshot older than the other's claim, so the
--   decision is made again under a transaction-level advisory lock of the key (a claim that cannot
--   have it skips the run: another claim is deciding for that key): the statement after the lock reads
--   a new snapshot (READ COMMITTED, a VOLATILE function), which holds every claim of the key that
--   committed, and none is in progress. runs_one_live_per_key_idx backs it.
CREATE OR REPLACE FUNCTION unitvisor.claim_jobs(
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
    job record;
    next_attempt integer;
    name text;
BEGIN
    PERFORM unitvisor.check_fence(claim_jobs.host_id, claim_jobs.host_epoch);
    SELECT * INTO me FROM unitvisor.hosts h WHERE h.id = claim_jobs.host_id;
    IF me.state <> 'active' OR NOT me.can_start THEN
        RETURN;
    END IF;
    PERFORM unitvisor.expire_overdue_runs();
    SELECT count(*), coalesce(sum(r.memory_max), 0) INTO in_flight, memory_used
    FROM unitvisor.attempts a JOIN unitvisor.runs r ON r.id = a.run_id
    WHERE a.host_id = claim_jobs.host_id AND a.outcome IS NULL;
    free := least(claim_jobs.batch, me.max_runs - in_flight);
    IF free <= 0 THEN
        RETURN;
    END IF;
    SELECT coalesce(sum(h.max_runs), 0) INTO capacity FROM unitvisor.hosts h
    WHERE unitvisor.host_is_live(h) AND h.can_start;
    SELECT count(*) INTO busy FROM unitvisor.attempts a JOIN unitvisor.hosts h ON h.id = a.host_id
    WHERE a.outcome IS NULL AND unitvisor.host_is_live(h) AND h.can_start;
    IF capacity > me.max_runs THEN
        SELECT count(*) INTO waiting FROM (
            SELECT 1 FROM unitvisor.spawn_jobs j JOIN unitvisor.runs r ON r.id = j.run_id
            WHERE j.state = 'available' AND j.scheduled_at <= now() AND r.state = 'queued'
              AND unitvisor.host_refusal(me, r) IS NULL AND unitvisor.also_accepted(me, r)
              AND (r.concurrency_key IS NULL OR unitvisor.concurrency_blocker(r) IS NULL)
            LIMIT capacity) w;
        share := ceil((busy + waiting)::numeric * me.max_runs / capacity)::bigint - in_flight;
    ELSE
        share := free;  -- no other live host: nothing to share
    END IF;
    FOR job IN
        -- Stale jobs (their run is not queued) of any pin are discarded by whoever meets them, so
        -- that the probe's "claimable" and this loop agree.
        SELECT j.id, j.run_id, j.scheduled_at, r.state AS run_state, r.memory_max, r.concurrency_key,
               share < free AND r.state = 'queued' AND unitvisor.also_accepted(me, r) AS contested
        FROM unitvisor.spawn_jobs j JOIN unitvisor.runs r ON r.id = j.run_id
        WHERE j.state = 'available' AND j.scheduled_at <= now()
          AND (r.state <> 'queued' OR (unitvisor.host_refusal(me, r) IS NULL
                                       AND (r.concurrency_key IS NULL OR unitvisor.concurrency_blocker(r) IS NULL)
                                       AND (r.start_deadline IS NULL OR NOT unitvisor.is_overdue(r))))
        ORDER BY j.priority DESC, j.scheduled_at, j.id
        -- No FOR UPDATE here: the loop fetches rows ten at a time, and it would lock every job it
        -- fetched, those it skips for a share or for memory too, until the claim commits; a
        -- concurrent claim would skip them all. Each job is locked when it is discarded or claimed.
    LOOP
        looked := looked + 1;
        IF job.run_state <> 'queued' THEN
            -- A job whose run moved on (cancelled, or started by a job claimed before it): it can
            -- only ever start the run twice, so it is discarded, not claimed.
            PERFORM 1 FROM unitvisor.spawn_jobs j WHERE j.id = job.id AND j.state = 'available'
                FOR UPDATE SKIP LOCKED;
            CONTINUE WHEN NOT FOUND;  -- another claim has it
            UPDATE unitvisor.spawn_jobs j SET state = 'discarded', claimed_by = claim_jobs.host_id,
                claimed_at = now(), error = 'run is already ' || job.run_state
            WHERE j.id = job.id;
            CONTINUE;
        END IF;
        EXIT WHEN taken >= free OR looked > 4 * claim_jobs.batch;
        IF job.contested AND shared >= share AND job.scheduled_at > now() - claim_jobs.spread_grace THEN
            CONTINUE;  -- another host's share, for now
        END IF;
        IF me.memory_budget IS NOT NULL AND memory_used + coalesce(job.memory_max, 0) > me.memory_budget THEN
            EXIT WHEN job.scheduled_at < now() - claim_jobs.starve_after;  -- it reserves the host
            CONTINUE;  -- backfill: a smaller run behind it may fit
        END IF;
        IF job.concurrency_key IS NOT NULL THEN
            -- The key's lock, then the decision again from a snapshot taken after it (see above).
            CONTINUE WHEN NOT pg_try_advisory_xact_lock(hashtextextended('unitvisor-concurrency-key:' || job.concurrency_key, 0));
            CONTINUE WHEN (SELECT unitvisor.concurrency_blocker(r) FROM unitvisor.runs r WHERE r.id = job.run_id) IS NOT NULL;
        END IF;
        PERFORM 1 FROM unitvisor.spawn_jobs j WHERE j.id = job.id AND j.state = 'available' FOR UPDATE SKIP LOCKED;
        CONTINUE WHEN NOT FOUND;  -- another claim has it, or took it since this loop's query began
        UPDATE unitvisor.spawn_jobs j SET state = 'claimed', claimed_by = claim_jobs.host_id, claimed_at = now()
        WHERE j.id = job.id;
        SELECT coalesce(max(a.attempt), 0) + 1 INTO next_attempt FROM unitvisor.attempts a WHERE a.run_id = job.run_id;
        name := format(claim_jobs.unit_format, job.run_id, next_attempt);
        UPDATE unitvisor.runs r SET state = 'starting', updated_at = now() WHERE r.id = job.run_id;
        DELETE FROM unitvisor.run_waits w WHERE w.run_id = job.run_id;
        INSERT INTO unitvisor.run_events (run_id, attempt, host_id, state, reason)
        VALUES (job.run_id, next_attempt, claim_jobs.host_id, 'starting', 'claimed by host ' || claim_jobs.host_id);
        INSERT INTO unitvisor.attempts AS a (run_id, attempt, host_id, unit_name)
        VALUES (job.run_id, next_attempt, claim_jobs.host_id, name)
        RETURNING a.run_id, a.attempt, a.unit_name, a.claimed_at
        INTO claim_jobs.run_id, claim_jobs.attempt, claim_jobs.unit_name, claim_jobs.claimed_at;
        RETURN NEXT;
        taken := taken + 1;
        shared := shared + job.contested::integer;
        memory_used := memory_used + coalesce(job.memory_max, 0);
    END LOOP;
END $$;

-- -- why a run waits --------------------------------------------------------------------------------

-- explain_waiting as in 002, with a second reason beside fleet_refusal's: the run of the same
-- concurrency key it waits for. Both when both hold (a host that accepted it would still have to wait).
CREATE OR REPLACE FUNCTION unitvisor.explain_waiting(min_wait interval, max_runs integer DEFAULT 1000)
RETURNS integer LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    WITH waiting AS (
        SELECT w.id, nullif(concat_ws('; ', w.keyed, w.refused), '') AS reason
        FROM (SELECT r.id, unitvisor.fleet_refusal(r) AS refused,
                     (SELECT 'waits for run ' || b.id || ' (' || b.state || ') with the same concurrency key'
                      FROM unitvisor.runs b WHERE b.id = unitvisor.concurrency_blocker(r)) AS keyed
              FROM unitvisor.spawn_jobs j JOIN unitvisor.runs r ON r.id = j.run_id
              WHERE j.state = 'available' AND j.scheduled_at <= now() - explain_waiting.min_wait AND r.state = 'queued'
              ORDER BY j.scheduled_at LIMIT explain_waiting.max_runs) w
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
    )
    SELECT count(*)::integer FROM events
$$;

-- Why a run waits, as run_status and the CLI show it: while it is queued, its not_before when that is
-- still ahead, else what explain_waiting recorded. Invoker's rights: it reads what the caller may.
CREATE FUNCTION unitvisor.wait_reason(r unitvisor.runs) RETURNS text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE WHEN r.state <> 'queued' THEN NULL
                WHEN r.not_before > now() THEN format('not before %s',
                    to_char(r.not_before AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS "UTC"'))
                ELSE (SELECT w.reason FROM unitvisor.run_waits w WHERE w.run_id = r.id) END
$$;
REVOKE EXECUTE ON FUNCTION unitvisor.wait_reason(unitvisor.runs) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.wait_reason(unitvisor.runs) TO unitvisor_submitter, unitvisor_host;

-- run_status as in 005 (same columns), with the new facts: wait_reason from wait_reason() (so a run
-- held by its not_before says so), and an expired run's outcome is `expired` and its reason the
-- expiry's (an expired run may have attempts that never started; how the run ended is the expiry).
CREATE OR REPLACE FUNCTION unitvisor.run_status(run_id uuid)
RETURNS TABLE (id uuid, state text, created_at timestamptz, finished_at timestamptz, attempts integer,
               attempt integer, host_id text, outcome text, exit_status text, reason text,
               cancel_requested boolean, wait_reason text, labels jsonb)
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT r.id, r.state, r.created_at, r.finished_at,
        (SELECT count(*)::integer FROM unitvisor.attempts c WHERE c.run_id = r.id),
        a.attempt, a.host_id,
        CASE WHEN r.state = 'expired' THEN 'expired' ELSE a.outcome END,
        a.exit_status,
        CASE WHEN r.state = 'expired' THEN (SELECT e.reason FROM unitvisor.run_events e
                                            WHERE e.run_id = r.id AND e.state = 'expired'
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

-- -- resume -----------------------------------------------------------------------------------------

-- resume_run as in 004, for expired runs too, and with the run's times: its new job is not due before
-- the run's not_before, and a start deadline that has passed (an expired run's always has) is dropped,
-- since resuming is the operator's decision to run it anyway; one still ahead is kept.
CREATE OR REPLACE FUNCTION unitvisor.resume_run(run_id uuid, OUT state text, OUT changed boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    resumed record;
BEGIN
    UPDATE unitvisor.runs r SET state = 'queued', cancel_requested_at = NULL, finished_at = NULL, updated_at = now(),
        start_deadline = CASE WHEN r.start_deadline <= now() THEN NULL ELSE r.start_deadline END
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

-- -- submit_run: three more arguments -------------------------------------------------------------
--
-- As in 005, with concurrency_key, not_before and start_deadline, last and defaulted, so that every
-- call written for versions 1 to 5 (positional or named) still means what it meant. DROP and CREATE
-- (the signature changes), then the grants again.
DROP FUNCTION unitvisor.submit_run(text[], jsonb, text, text, bigint, integer, integer, integer, bigint,
    integer, text, integer, integer, integer, text[], boolean, text, jsonb);
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

REVOKE EXECUTE ON FUNCTION unitvisor.submit_run(text[], jsonb, text, text, bigint, integer, integer, integer,
    bigint, integer, text, integer, integer, integer, text[], boolean, text, jsonb, text, timestamptz,
    timestamptz) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.submit_run(text[], jsonb, text, text, bigint, integer, integer, integer,
    bigint, integer, text, integer, integer, integer, text[], boolean, text, jsonb, text, timestamptz,
    timestamptz) TO unitvisor_submitter;

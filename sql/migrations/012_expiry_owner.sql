-- unitvisor schema: one owner for expiry, and a clear refusal of runs_with_labels' max_rows (issue 13).
--
-- Expiry. Until now two callers expired the overdue runs (expire_overdue_runs): every claim, first
-- thing, and the daemons' fleet upkeep (expire_runs). The claim's expiries reached no metric: it
-- returns the runs it claimed, not how many it expired, so unitvisor_runs_expired_total, summed over
-- the fleet, was a lower bound (docs/metrics.md). Now the upkeep is the one caller, chosen over a
-- claim that reports its count because the claim's result is a row per claimed run, which 0.4.0 and
-- 0.5.0 daemons read and which no migration can widen under them:
--
-- * claim_jobs as in 009, without the expiry. It never took an overdue run anyway (its query leaves
--   them out, is_overdue); what the claim's expiry gave was promptness, the run ended at the next claim
--   of any host instead of at the upkeep's next pass. Its fair share no longer counts the jobs of runs
--   past their deadline as waiting (they were gone by then when the claim expired them first).
-- * expire_overdue_runs as in 006, its candidates chosen among the runs it can expire: it took the
--   first 1000 queued runs past their deadline and only then asked is_overdue, so 1000 retries past
--   their deadline (which started once, and are never expired) hid every overdue run behind them,
--   and with the heartbeat's flag below every daemon would have run an upkeep each poll for nothing.
-- * heartbeat as in 004, with that promptness moved to it: its `upkeep` flag is also set while a queued
--   run is overdue, so a live daemon runs its upkeep, and expires the run, within one or two poll intervals
--   of its deadline, and counts it. Its `claimable` flag leaves overdue runs out, as the claim does, so
--   that an overdue run does not make every daemon claim (nothing) until it is expired. The flag's
--   question is one probe of runs_start_deadline_idx (006), empty where nobody uses deadlines.
--   It still counts runs that wait behind a run of their concurrency key as work (the claim finds
--   nothing): leaving them out would make the heartbeat, the statement that keeps a host alive, walk
--   every such job with host_refusal before it answers.
--
-- An overdue run still holds its concurrency key until the upkeep expires it (concurrency_blocker as in
-- 006): the runs behind it wait that long, one or two poll intervals, where the claim used to expire
-- it first and take them at once. Chosen over a blocker that skips overdue runs, which would look at
-- every overdue run ahead of a queued one of its key (is_overdue each), on every job the claim meets:
-- quadratic in a key's overdue runs, while they wait for the upkeep.
--
-- What would break if the claim expired runs again: the counter would count only the upkeep's share.
-- Daemons of 0.4.0 and 0.5.0 run their upkeep on this flag too (0.5.0 counts what it expires; 0.4.0 has
-- no such counter); 0.3.0 daemons, which expired runs only through their claims, are not supported under
-- this schema (README, Upgrade: one release at a time).
--
-- runs_with_labels(max_rows => -1) failed with PostgreSQL's own "LIMIT must not be negative", which
-- does not name the argument: the one refusal of the SQL API that did not. It is LANGUAGE sql (see 005),
-- which cannot raise, so the check is a helper, unitvisor.max_rows_bound, granted to the same roles.
--
-- Every function keeps its name, arguments and result (CREATE OR REPLACE): callers of 0.4.0 and 0.5.0
-- are unaffected.

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
    next_attempt integer;
    name text;
    enough bigint;
    -- host_refusal(me, r) and also_accepted(me, r) of each kind of run met (what they read of a run
    -- besides the pin: argv[0], user, environment, memory_max), at most 64 kinds each: a burst is
    -- mostly runs of a few kinds, and each call costs tens of microseconds (also_accepted one
    -- host_refusal per other host until one accepts), on every row a claim looks at.
    refusals jsonb := '{}';
    accepted jsonb := '{}';
    contested boolean;
    -- A bound cursor, not FOR ... IN SELECT: PL/pgSQL plans a bound cursor for its first rows
    -- (cursor_tuple_fraction), so it walks spawn_jobs_available_idx in claim order and evaluates
    -- host_refusal only on the rows it fetches; FOR ... IN SELECT plans for every row, and chose to
    -- filter the whole queue, then sort it (see the head of sql/009_claim_cost.sql).
    jobs CURSOR FOR
        -- Stale jobs (their run is not queued) of any pin are discarded by whoever meets them, so
        -- that the probe's "claimable" and this loop agree.
        -- host_refusal(me, r) is asked in the loop, once per kind of run (see `refusals`); the pin is a
        -- column here: a queue of runs pinned to other hosts costs an index walk, no call each.
        SELECT j.id, j.run_id, j.scheduled_at, r.state AS run_state, r.memory_max, r.concurrency_key,
               r.host_pin, jsonb_build_array(r.argv[1], r.run_user, r.environment, r.memory_max)::text AS kind,
               r AS run
        FROM unitvisor.spawn_jobs j JOIN unitvisor.runs r ON r.id = j.run_id
        WHERE j.state = 'available' AND j.scheduled_at <= now()
          AND (r.state <> 'queued' OR ((r.host_pin IS NULL OR r.host_pin = me.id)
                                       AND (r.concurrency_key IS NULL OR unitvisor.concurrency_blocker(r) IS NULL)
                                       AND (r.start_deadline IS NULL OR NOT unitvisor.is_overdue(r))))
        ORDER BY j.priority DESC, j.scheduled_at, j.id
        -- No FOR UPDATE here: the loop fetches rows ten at a time, and it would lock every job it
        -- fetched, those it skips for a share or for memory too, until the claim commits; a
        -- concurrent claim would skip them all. Each job is locked when it is discarded or claimed.
        ;
BEGIN
    PERFORM unitvisor.check_fence(claim_jobs.host_id, claim_jobs.host_epoch);
    SELECT * INTO me FROM unitvisor.hosts h WHERE h.id = claim_jobs.host_id;
    IF me.state <> 'active' OR NOT me.can_start THEN
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
        -- Counted up to `enough` only: from there on the share is at least `free`, and holds nothing
        -- back (the share is monotone in `waiting`; `enough` leaves out the `- busy` that would make it
        -- exact, so that both counts can be one statement). And counted by columns, not by
        -- host_refusal and also_accepted (see the head of sql/009_claim_cost.sql).
        enough := least(capacity, ceil((free + in_flight)::numeric * capacity / me.max_runs)::bigint);
        -- busy and waiting in one statement, so from one snapshot: as two statements (006), a claim
        -- that committed between them was in neither count, and this host's share shrank by a third
        -- of it (three hosts claiming a burst at once took 14, 20 and 20 of 60, leaving 6 behind).
        SELECT (SELECT count(*) FROM unitvisor.attempts a JOIN unitvisor.hosts h ON h.id = a.host_id
                WHERE a.outcome IS NULL AND unitvisor.host_is_live(h) AND h.can_start),
               (SELECT count(*) FROM (
                    SELECT 1 FROM unitvisor.spawn_jobs j JOIN unitvisor.runs r ON r.id = j.run_id
                    WHERE j.state = 'available' AND j.scheduled_at <= now() AND r.state = 'queued'
                      AND (r.host_pin IS NULL OR r.host_pin = me.id)
                      -- Not a run past its deadline, which no claim takes (012; a retry past its
                      -- deadline that started once is left out too, a count by columns).
                      AND (r.start_deadline IS NULL OR r.start_deadline > now())
                    LIMIT greatest(enough, 0)) w)
        INTO busy, waiting;
        share := ceil((busy + waiting)::numeric * me.max_runs / capacity)::bigint - in_flight;
    ELSE
        share := free;  -- no other live host: nothing to share
    END IF;
    FOR job IN jobs LOOP
        IF job.run_state = 'queued' THEN
            -- A run this host refuses is skipped as if the query had not returned it (as in 006).
            IF refusals ? job.kind THEN
                CONTINUE WHEN (refusals ->> job.kind)::boolean;
            ELSIF unitvisor.host_refusal(me, job.run) IS NOT NULL THEN
                refusals := unitvisor.claim_memo(refusals, job.kind, true);
                CONTINUE;
            ELSE
                refusals := unitvisor.claim_memo(refusals, job.kind, false);
            END IF;
        END IF;
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
        -- Contested: another live host would take it too (as 006's column, asked here, per kind).
        IF share >= free OR job.host_pin IS NOT NULL THEN
            contested := false;  -- nothing to share; or pinned to this host, which no other host takes
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
        shared := shared + contested::integer;
        memory_used := memory_used + coalesce(job.memory_max, 0);
    END LOOP;
END $$;


-- expire_overdue_runs as in 006, with the started-once test in the candidates' query, before the LIMIT.
CREATE OR REPLACE FUNCTION unitvisor.expire_overdue_runs(max_runs integer DEFAULT 1000) RETURNS integer
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

CREATE OR REPLACE FUNCTION unitvisor.heartbeat(host_id text, host_epoch bigint, waited interval)
RETURNS TABLE (host_state text, claimable boolean, cancels boolean, upkeep boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM unitvisor.require_host(heartbeat.host_id);
    RETURN QUERY
    UPDATE unitvisor.hosts h SET heartbeat_at = now()
    WHERE h.id = heartbeat.host_id AND h.epoch = heartbeat.host_epoch AND h.state <> 'dead'
    RETURNING h.state,
        EXISTS (SELECT 1 FROM unitvisor.spawn_jobs j JOIN unitvisor.runs r ON r.id = j.run_id
                WHERE j.state = 'available' AND j.scheduled_at <= now()
                  AND (r.state <> 'queued' OR (unitvisor.host_refusal(h, r) IS NULL
                                               AND (r.start_deadline IS NULL OR NOT unitvisor.is_overdue(r))))),
        EXISTS (SELECT 1 FROM unitvisor.attempts a JOIN unitvisor.runs r ON r.id = a.run_id
                WHERE a.host_id = heartbeat.host_id AND a.outcome IS NULL AND r.cancel_requested_at IS NOT NULL),
        EXISTS (SELECT 1 FROM unitvisor.hosts o WHERE o.id <> h.id AND unitvisor.host_is_overdue(o))
        OR EXISTS (SELECT 1 FROM unitvisor.spawn_jobs j
                   WHERE j.state = 'available' AND j.scheduled_at <= now() - heartbeat.waited)
        OR EXISTS (SELECT 1 FROM unitvisor.runs r
                   WHERE r.state = 'queued' AND r.start_deadline <= now() AND unitvisor.is_overdue(r));
END $$;

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
REVOKE EXECUTE ON FUNCTION unitvisor.max_rows_bound(integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.max_rows_bound(integer) TO unitvisor_submitter, unitvisor_host;

-- runs_with_labels as in 005, its bound through max_rows_bound.
CREATE OR REPLACE FUNCTION unitvisor.runs_with_labels(labels jsonb, max_rows integer DEFAULT 100)
RETURNS TABLE (id uuid, state text, created_at timestamptz, finished_at timestamptz, attempts integer,
               attempt integer, host_id text, outcome text, exit_status text, reason text,
               cancel_requested boolean, wait_reason text, labels jsonb)
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT s.* FROM (SELECT r.id AS run_id, r.created_at AS run_created_at FROM unitvisor.runs r
                     WHERE r.labels @> runs_with_labels.labels
                     ORDER BY r.created_at DESC, r.id LIMIT unitvisor.max_rows_bound(runs_with_labels.max_rows)) m
    CROSS JOIN LATERAL unitvisor.run_status(m.run_id) s
    ORDER BY m.run_created_at DESC, m.run_id
$$;

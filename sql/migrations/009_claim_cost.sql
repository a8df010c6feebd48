-- unitvisor schema: the claim's cost under a backlog and with hundreds of hosts (issue 14).
--
-- claim_jobs as in 006, deciding the same, at a cost bounded by what it takes, not by the queue:
--
-- * The loop's query walks spawn_jobs_available_idx in claim order, so host_refusal and also_accepted
--   run on the rows it fetches only. In 006 it was a FOR ... IN SELECT, which PL/pgSQL plans for every
--   row: the planner filtered the whole queue through host_refusal (regular expressions) and then
--   sorted it, ~230 ms for 10,000 queued jobs before the first one was taken, on every claim. A bound
--   cursor is planned for its first rows. tests/integration/test_claim_cost.py holds it to that.
--
-- * host_refusal(me, r) and also_accepted(me, r) are asked once per kind of run the claim meets (what
--   they read of a run besides the pin: argv[0], user, environment, memory_max), not once per job: a
--   claim past its share looks at up to 4 x batch young jobs of a burst, and asked both of each, ~70 us
--   per host_refusal call, 258 calls and ~30 ms per claim on a 300-host fleet. A run pinned to this
--   host is not contested (no other host takes it) without asking.
--
-- * The fair share's count of waiting jobs. In 006 it ran host_refusal(me, r) and also_accepted(me, r)
--   (host_refusal once more for every other live host, until one accepts) on up to `capacity` jobs:
--   with 300 hosts of 8 runs, 2,400 jobs and ~340 ms, and a claim over 10,000 queued jobs that this
--   host refuses read them all. Now:
--   - it stops at `enough`, the count from which this host's share is at least its `free` slots: from
--     there the share holds nothing back, so counting further cannot change the claim (the share only
--     grows with the count);
--   - it counts by columns: an available, due job of a queued run that is not pinned to another host.
--     Runs this host or every other host refuses by allowlist, user, environment or memory, and runs
--     whose concurrency key holds them back, count as waiting too. The consequence: where such runs
--     are a large part of the queue, the share comes out larger than 006's, so a host takes more of a
--     burst's shared runs in the burst's first spread_grace (1 s) than its strict share; after
--     spread_grace nothing is held back anyway. Which runs it takes does not change: host_refusal
--     still decides every one, in the loop, so a host never claims a run it refuses. The share is a
--     spreading heuristic for the first second of a burst, and a count that costs the whole queue's
--     regular expressions on every claim of every host is what made a 300-host fleet time out.
--
-- Expand only: claim_jobs keeps its signature (0.3.0 and 0.4.0 call it); one new helper, claim_memo.

-- claim_jobs' memo of one answer per kind of run: `memo` with `kind` set to `answer`, unless it holds
-- 64 kinds already (the claim then asks again for further kinds: a bound on its memory, not on its
-- answers).
CREATE FUNCTION unitvisor.claim_memo(memo jsonb, kind text, answer boolean) RETURNS jsonb
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE WHEN (SELECT count(*) FROM jsonb_object_keys(memo)) >= 64 THEN memo
                ELSE memo || jsonb_build_object(kind, answer) END
$$;
REVOKE EXECUTE ON FUNCTION unitvisor.claim_memo(jsonb, text, boolean) FROM PUBLIC;

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
    -- filter the whole queue, then sort it (see the head of this file).
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
    IF capacity > me.max_runs THEN
        -- Counted up to `enough` only: from there on the share is at least `free`, and holds nothing
        -- back (the share is monotone in `waiting`; `enough` leaves out the `- busy` that would make it
        -- exact, so that both counts can be one statement). And counted by columns, not by
        -- host_refusal and also_accepted (see the head of this file).
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

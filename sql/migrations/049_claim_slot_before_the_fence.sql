-- unitvisor schema: a claim waiting for one of the fleet's claim slots no longer holds its host's row, so
-- that the host's heartbeat never waits behind its own claim (issue 23: a busy database never kills a live
-- host).
--
-- claim_jobs begins with check_fence, which reads the host's row FOR SHARE (a take-over's change of epoch
-- waits for the claim, and so cannot slip between its check and its commit), and that lock lasts to the
-- end of the claim's transaction. 046 then took a claim slot, waiting up to lock_timeout (5 s) when all
-- were held, which in a burst is most claims: bench.scale's burst of 10,000 runs on 300 hosts sent 292
-- hosts' heartbeats aside (their loops waiting in claims), and 90 of those failed on lock_timeout
-- "while locking tuple ... in relation hosts": the heartbeat is an update of the same row, and waited for
-- the share lock of its own host's claim. Now the slot comes first, with nothing locked; the fence and the
-- walk follow as before. A host whose run slots are all taken takes no slot, as in 046, read from
-- host_open_attempts (one row) without a lock.

-- claim_jobs as in 046, the slot taken before the fence.
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

-- unitvisor schema: the heartbeat leaves a job just submitted to the hosts its submit woke (issue 23: a
-- single submit wakes at most 3 daemons, at every size).
--
-- A submit's COMMIT notifies the hosts it names (notify_spawn_targets: the two with the most room, or as
-- many as the burst needs), and they claim at once. Every other host's heartbeat, the fallback poll,
-- also answered "there is work" while the job waited for that claim, and its daemon claimed too, for
-- nothing. On a fleet of 1,000 hosts polling every 10 s that is 100 heartbeats a second: bench.scale
-- measured a single submit's claim p50 at 62 ms on a loaded machine, and 10 daemons claiming for it (p95
-- 292 ms and 27, max 415 ms and 59: about two woken and one more for every 10 ms the job waited), 9 of
-- them empty. The slower the database, the more claims each submit draws, each a walk of the queue: a
-- load that feeds itself.
--
-- Now a heartbeat called with `left_to_woken` (the daemon passes its spread grace, fleet.SPREAD_GRACE:
-- 1 s, the window in which claim_jobs keeps a burst's jobs to the fair shares) does not count a keyless job
-- that was due when it was made (scheduled_at = created_at: a submit, a release, a resume, a dependency
-- met, a retry without delay, each notified at its commit) until it is that old; its "no" is kept until
-- then at most (work_until), so the first heartbeat after it finds the job, as every heartbeat did before.
-- What this costs: a job whose woken hosts did not take it (their daemons restarting, the notification
-- lost, a drain between the submit and the claim) waits up to 1 s more for the fallback poll, which came
-- up to a poll interval later anyway. A job made due later (not_before, a retry's backoff) was notified
-- to nobody, and counts as soon as it is due, as before; so do keyed jobs (their key's room decides who
-- was woken). A daemon passes no grace until its connection has listened for as long (a start, a
-- reconnect: it may have missed the notification, which may have gone to nobody, a single host
-- restarting). A daemon of 0.11.0 calls heartbeat with three arguments, and keeps the old answer.

DROP FUNCTION unitvisor.heartbeat(text, bigint, interval);
DROP FUNCTION unitvisor.host_has_work(unitvisor.hosts);

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

REVOKE EXECUTE ON FUNCTION unitvisor.host_has_work(unitvisor.hosts, interval),
                           unitvisor.heartbeat(text, bigint, interval, interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.heartbeat(text, bigint, interval, interval) TO unitvisor_host;

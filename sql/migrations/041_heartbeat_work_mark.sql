-- unitvisor schema: a heartbeat asks "is there work for me" again only when something that could change
-- the answer has changed (issue 23, point 4: 1,000 runs that no host accepts, and 10,000 behind one key,
-- add at most 5% to the idle fleet's server CPU at 300 hosts).
--
-- Before: every heartbeat called host_has_work, which walks the queue one kind and one key at a time and
-- asks host_refusal of each kind's oldest run and key_head and concurrency_blocker of each key. On an idle
-- queue that is two index probes that find nothing; with runs waiting that nobody may start, it is the
-- same walk every poll interval on every host, for the same "no". In bench.scale at 300 hosts a heartbeat
-- took 1.80 ms with either backlog against 0.79 ms idle (docs/benchmarks.md, "0.11.0 with 040"), and
-- (S4) and (S5) cost 3.0x and 2.0x the idle fleet.
--
-- Now a heartbeat that answers "no" keeps, on its host's row, a mark of what the answer was read from
-- (work_mark) and how long it holds by the clock alone (work_until); the next heartbeat whose mark is the
-- same, before work_until, answers "no" without the walk. The mark, read before the walk (a change that
-- commits between the two makes the next mark differ, never the other way round):
--
-- * the newest spawn job's id: every job that becomes available is a new row (a submit, a retry, a
--   respawn, a release from hold, a dependency met), never an old row made available again;
-- * the newest run event's id: every change of a run's state writes one (an outcome, which ends a key's
--   blocker and frees its host's slot; a cancel; a hold), as do freezes;
-- * the columns of the host's own row that host_has_work and host_refusal read (host_refusal_inputs).
--
-- work_until is the earliest scheduled_at of an available job still in the future (a not_before, a retry's
-- backoff: due by the clock alone, with no new row), and at most 30 poll intervals (5 minutes by default)
-- after the walk. That bound is for the one change a mark can miss: a transaction that drew its id before
-- a later one committed, and commits itself after the walk (ids are drawn in order, committed in any); the
-- mark moves with the next change anywhere in the fleet, and other hosts' heartbeats that walked after
-- the commit see it. What it costs: on a host whose last walk fell in that window, work waits up to
-- those 30 intervals unless anything else in the fleet changes first or the submitter's wake names it
-- (a submit's NOTIFY, 010, still wakes the hosts it names at once). Why 30 and not 1: the walk is what
-- (S4) and (S5) cost; once an interval on every host, it is what they cost now.
--
-- An empty queue (no job available) is "no" at the cost of one index probe, with no mark, as before.
-- A "yes" keeps no mark: the daemon claims, and its next heartbeat walks again. Named limits (032) are
-- not in the mark: host_has_work does not read them (a run a full limit holds back is "maybe", and the
-- claim finds the limit full), so no "no" rests on them.

ALTER TABLE unitvisor.hosts ADD COLUMN work_mark text, ADD COLUMN work_until timestamptz;

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
-- and the newest run event's id, two newest-first probes of the primary keys. With the host's
-- host_refusal_inputs, 6 us in all, against 8 us for host_has_work on an idle queue (a throwaway
-- PostgreSQL 15).
CREATE FUNCTION unitvisor.queue_mark() RETURNS text
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN format('%s/%s', coalesce((SELECT max(j.id) FROM unitvisor.spawn_jobs j), 0),
                  coalesce((SELECT max(e.id) FROM unitvisor.run_events e), 0));
END $$;

-- When the clock alone next changes what the queue holds for a look that counts jobs due for `waited`:
-- the earliest available job not yet due that long, at the moment it will be; NULL when there is none.
CREATE FUNCTION unitvisor.next_due(waited interval) RETURNS timestamptz
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN (SELECT min(j.scheduled_at) FROM unitvisor.spawn_jobs j
            WHERE j.state = 'available' AND j.scheduled_at > now() - next_due.waited) + next_due.waited;
END $$;
REVOKE EXECUTE ON FUNCTION unitvisor.host_refusal_inputs(unitvisor.hosts), unitvisor.queue_mark(),
    unitvisor.next_due(interval) FROM PUBLIC;

-- heartbeat as in 040, its claimable from host_has_work only when the host's work mark moved or its
-- work_until passed; a "no" walked for is remembered on the host row with the heartbeat.
CREATE OR REPLACE FUNCTION unitvisor.heartbeat(host_id text, host_epoch bigint, waited interval)
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
        -- Before the walk: see the head of this file.
        mark := unitvisor.queue_mark() || '/' || unitvisor.host_refusal_inputs(me);
        IF mark IS DISTINCT FROM me.work_mark OR NOT now() < me.work_until THEN
            has_work := unitvisor.host_has_work(me);
            IF NOT has_work THEN
                until := least(now() + 30 * make_interval(secs => coalesce(me.poll_interval_sec, 10)),
                               unitvisor.next_due('0'));
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

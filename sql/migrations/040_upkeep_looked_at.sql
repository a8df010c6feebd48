-- unitvisor schema: an idle fleet is looked at for upkeep once a poll interval, not at every heartbeat
-- (issue 23: the idle fleet's server CPU per host per minute, flat from 100 to 1,000 hosts and at most
-- 10 ms).
--
-- Since 029 a heartbeat makes the upkeep looks (a silent host to declare dead, a job that waited two
-- poll intervals, a run past its start deadline) only while the fleet upkeep's turn is due. But in an
-- idle fleet nobody takes the turn, since the looks find nothing: the turn stays due, and every
-- heartbeat of every host made the looks. The first walks every host row (a host may be overdue by its
-- own host_dead_after, so no index answers it), and the heartbeat's executor time grew with the fleet:
-- 1.17, 1.50 and 2.36 ms at 100, 300 and 1,000 hosts (bench.scale, 0.11.0), against 0.38 ms for a
-- heartbeat without the looks (a throwaway PostgreSQL 15, warm).
--
-- Now a look that finds nothing is remembered fleet-wide (fleet_upkeep.looked_at), and the heartbeats of
-- the next poll interval (the heartbeat's host's own, as for the turn) do not look again: one look an
-- interval for the whole fleet while it is idle. A look that finds something is not remembered, so
-- every heartbeat says "upkeep" until a daemon takes the turn, as before.
--
-- What it costs: what the looks find (a host fallen silent, a job that has waited, a run past its start
-- deadline) is found up to one poll interval later than before: a silent host is declared dead
-- host_dead_after (60 s by default) after its last heartbeat plus up to one poll interval (10 s by
-- default), where it was plus up to one heartbeat; a waiting run is explained up to an interval later.
--
-- The stamp is written with SKIP LOCKED: the row is also the turn's lease and the explain pass's
-- bookmark, and a heartbeat never waits behind either (docs/fleet.md: heartbeats that cannot be
-- starved). A heartbeat that finds the row locked leaves the stamp as it was: the next heartbeat looks.

ALTER TABLE unitvisor.fleet_upkeep ADD COLUMN looked_at timestamptz NOT NULL DEFAULT '-infinity';

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

-- heartbeat as in 030, its upkeep looks made by upkeep_looks: once a poll interval in an idle fleet.
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
        -- The turn first: while it is not due, the looks are not made.
        ((SELECT u.turn_at FROM unitvisor.fleet_upkeep u) <= now() - make_interval(secs => coalesce(h.poll_interval_sec, 10))
         AND unitvisor.upkeep_looks(h.id, heartbeat.waited, make_interval(secs => coalesce(h.poll_interval_sec, 10))))
        OR EXISTS (SELECT 1 FROM unitvisor.schedules s WHERE NOT s.paused AND s.next_due <= now());
END $$;

REVOKE EXECUTE ON FUNCTION unitvisor.upkeep_looks(text, interval, interval) FROM PUBLIC;

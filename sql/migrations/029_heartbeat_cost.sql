-- unitvisor schema: what a heartbeat costs stops growing with the fleet (issue 23, point 4: the idle
-- fleet's server CPU per host grew with the number of hosts; runs waiting made every host ask for the
-- fleet upkeep's turn).
--
-- 1. The look for a silent host costs no function call per host.
--
-- Before: every heartbeat asked `EXISTS (SELECT 1 FROM hosts o WHERE o.id <> h.id AND
-- host_is_overdue(o))`, to say whether the fleet upkeep has a silent host to declare dead. When no host
-- is silent (an idle fleet: always) that walks every host row, and host_is_overdue, a SQL function whose
-- body held a subquery (the open attempts of a stopped host), cannot be inlined by the planner: it ran as
-- a function call of its own, with its own executor start and end, for every other host, on every
-- heartbeat of every host. Measured on a throwaway database (docs/benchmarks.md, 0.8.0 measured): a
-- heartbeat took 1.36 ms of backend CPU with 100 host rows and 2.47 ms with 300, against 0.56 and 0.63
-- ms without the look (the loaded 2-core machine); so the fleet's idle server CPU per host per minute
-- grew with the number of hosts (bench.scale, 0.8.0: 15.4 ms at 100 hosts, 21.9 ms at 300).
--
-- Now host_is_overdue has no subquery: the open attempts of a stopped host are asked by a function of
-- their own (host_has_open_attempt), which runs only for a stopped host silent past its host_dead_after.
-- The planner then inlines host_is_overdue wherever it is called (the heartbeat, declare_dead,
-- declare_dead_hosts) and the look at a host row is a few comparisons of its columns. The answer is the
-- same for every row (tests/integration/test_fleet_sql.py and test_fleet_upkeep.py); what is left is the
-- walk over the host rows' pages, a few hundred buffers at 1,000 hosts
-- (tests/integration/test_heartbeat_cost.py counts the function calls).
--
-- 2. Only the hosts that could get the fleet upkeep's turn are told to ask for it. The heartbeat's upkeep
-- flag said "there is upkeep" to every host while a job had waited two poll intervals (or a host was
-- silent, or a run overdue), and every daemon so told asked for the turn once a poll interval
-- (fleet_upkeep_turn), of which one a poll interval wins: bench.scale measured 12.5 statements per host
-- per minute with 1,000 refused runs waiting at 300 hosts against 7.0 idle, and 1.85x the idle server
-- CPU (docs/benchmarks.md, 0.8.0 measured). Now the flag is true only while the turn is due (a poll
-- interval since the last one was given, the rule fleet_upkeep_turn gives it by), and the looks for
-- upkeep are made only then: one or two daemons ask an interval, the ones whose heartbeat comes first.
-- Measured apart at 300 host rows with 1,000 refused runs: 300 turn requests and 1.97 ms of server CPU
-- per host per poll interval before, 1 request and 0.69 ms after.
-- The upkeep itself is unchanged (one pass a poll interval, by whoever asks first); a silent host is
-- seen by the first heartbeat once the turn is due, at most a poll interval after its last pass.
-- (tests/integration/test_heartbeat_cost.py.)
--
-- Expand only: the same function names, arguments and results; a 0.8.0 daemon calls the same heartbeat
-- and asks for the turn when told, as before.

-- Whether the host has an attempt that no outcome settled yet.
CREATE FUNCTION unitvisor.host_has_open_attempt(host_id text) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM unitvisor.attempts a
                   WHERE a.host_id = host_has_open_attempt.host_id AND a.outcome IS NULL)
$$;
REVOKE EXECUTE ON FUNCTION unitvisor.host_has_open_attempt(text) FROM PUBLIC;

-- host_is_overdue as in 002, its open-attempt question moved into host_has_open_attempt: a SQL function
-- without a subquery (and without SET, SECURITY DEFINER or STRICT) is inlined by the planner.
CREATE OR REPLACE FUNCTION unitvisor.host_is_overdue(h unitvisor.hosts) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT h.heartbeat_at < now() - make_interval(secs => coalesce(h.dead_after_sec, 60))
       AND (h.state IN ('active', 'draining')
            OR (h.state = 'stopped' AND unitvisor.host_has_open_attempt(h.id)))
$$;

-- heartbeat as in 020, its upkeep flag true only while the fleet's turn is due (a poll interval after the
-- last turn was given, fleet_upkeep_turn's own rule): then one or two daemons ask for the turn an
-- interval, not every daemon of the fleet. 028's flag for a due schedule stays as it was, turn or not
-- (the step that submits schedules' runs is every flagged daemon's, and a schedule is due for moments).
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
                WHERE a.host_id = heartbeat.host_id AND a.outcome IS NULL AND r.cancel_requested_at IS NOT NULL),
        -- The turn first: while it is not due, the looks below are not made.
        ((SELECT u.turn_at FROM unitvisor.fleet_upkeep u) <= now() - make_interval(secs => coalesce(h.poll_interval_sec, 10))
         AND (EXISTS (SELECT 1 FROM unitvisor.hosts o WHERE o.id <> h.id AND unitvisor.host_is_overdue(o))
              OR EXISTS (SELECT 1 FROM unitvisor.spawn_jobs j
                         WHERE j.state = 'available' AND j.scheduled_at <= now() - heartbeat.waited)
              OR EXISTS (SELECT 1 FROM unitvisor.runs r
                         WHERE r.state = 'queued' AND r.start_deadline <= now() AND unitvisor.is_overdue(r))))
        OR EXISTS (SELECT 1 FROM unitvisor.schedules s WHERE NOT s.paused AND s.next_due <= now());
END $$;
